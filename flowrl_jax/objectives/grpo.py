"""The clipped GRPO objective on (sample, step) pairs with a KL to a frozen reference (docs/math.md §4).

    loss, aux = clipped_loss(trees, mb, fns, options)     # trees: batch.ParamTrees; fns: rl.policy.PolicyFns (its `mean`)

`mb` is a `batch.Minibatch` of M (sample, step) pairs gathered from a rollout (`gather_pairs`): states `x`,
next states `x_next [M, H, W, C]`, the step's `sigma`, `sigma_next`, noise level `level`, the step
index `step [M]`, the rollout policy's per-token log-probs `logp_old [M, N]`, the advantages
`adv [M, K]` (K = 1 or N), the condition, and a `weight [M]` (0 on padding). `fns.mean(params, mb) ->
(mean, std, v)` is the kernel mean (and std, and velocity at `mb.x`) of the policy with `params` at
`mb.x` (the same kernel as the rollout). Options (`DEFAULTS`, `config.objective.grpo`): clip_range,
beta, ratio, kl_form, lambda_control.

- Ratio per sample (Flow-GRPO default): `rho = exp(mean_k l_theta - mean_k l_old)` with the token-mean
  advantage; per token (`ratio="token"`, what spatial credit needs): `rho[k] = exp(l_theta[k] - l_old[k])`.
- `L = -mean[min(rho A, clip(rho, 1 - eps, 1 + eps) A)] + beta KL`; the mean is over pairs (and tokens).
- `KL = mean_e (mu_theta - mu_ref)^2 / (2 s^2)`: `kl_form="flow_grpo"` (default, Flow-GRPO's code) takes
  `s` = the kernel's std without its `sqrt(-dt)` factor; `"exact"` the std itself, the exact KL between the
  two Gaussian kernels (larger by `1 / (sigma - sigma_next)`, ~9x at shift 1, 10 steps, for the same beta).
- `detach_uncond` (off by default, as flow_grpo's current `train_sd3.py` and its GRPO-Guard script: the gradient flows
  through both CFG branches, `cfg dv_c - (cfg - 1) dv_u`); on: no gradient through CFG's unconditional branch
  (`rollout.guided`; flow_grpo's July 2025 version), which also halves the backward pass's batch.
- Reported: clipfrac (overall and per step), approx_kl (`0.5 mean (log rho)^2`), the KL, the ratio's
  mean/std per step, the path variance `V_t` per step, measured and predicted (below), and `alignment`,
  the correlation of advantage and log-ratio over the minibatch's pairs (the train loop keeps it for
  pairs no update has seen yet: `alignment_heldout`).

lambda-controlled GRPO (`lambda_control=True`, `configs/lambda_grpo.py`, docs/math.md §4). With `dmu = mu_theta - mu_old`
the mean-reduced log-ratio has mean `-V/2` and variance `V/D`, `V = mean_e(dmu^2) / std^2`. Measured:
`V` from the kernel means. Predicted: `kappa_t mean_e(dv^2)` with `dv = v_theta - v_old`
(`v_old = (x - x0_hat) / sigma` from the rollout's Tweedie estimate) and the step's cost
`kappa_t = c_t^2 / std_t^2`, `c_t = d mu / d v` (`kernels.affine_coefficients`); the two agree for the
affine kernels (sde, cps). The objective then (i) calibrates `rho~ = rho exp(sg(V) / 2)` (per sample,
or per token with the token's V), (ii) clips `rho~` at `eps`, (iii) weights each pair by the effort
`w_t = (1 / kappa_t) / mean_u(1 / kappa_u)` over the trained steps u, (iv) drops the gradient of the
steps whose minibatch-mean `V_t` exceeds the budget `lambda D = eps^2 D` that round.

GRPO-Guard (`ratio_norm=True`, `configs/grpo_guard.py`; flow_grpo's `scripts/train_sd3_GRPO_Guard.py`, `config.rationorm`):
RatioNorm `log rho = (mean_e l_theta - mean_e l_old + mean_e dmu^2 / (2 std^2)) std` per sample (no stop-gradient; with
`x' = mu_old + std eps` it is `mean_e eps dmu`, centred at 0 whatever the step's std), then each pair's clipped term is
divided by `sigma - sigma_next` (= `sqrt(-dt)^2`, upstream's gradient reweighting across steps).
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np

from flowrl_jax.models.mmdit import patchify
from flowrl_jax.objectives.batch import IterationData, Minibatch, ParamTrees
from flowrl_jax.sampling import kernels
from flowrl_jax.sampling.rollout import Rollout, Schedule

DEFAULTS = {"clip_range": 1e-4, "beta": 0.04, "ratio": "sample", "kl_form": "flow_grpo", "lambda_control": False,
            "detach_uncond": False, "ratio_norm": False}
RATIOS = ("sample", "token")
KL_FORMS = ("exact", "flow_grpo")
AFFINE_KINDS = ("sde", "cps")


def check(options, sampler) -> None:
    """ValueError naming the option when `options` (resolved) cannot train on `sampler`'s rollouts."""
    if options.ratio not in RATIOS:
        raise ValueError(f"objective.grpo.ratio={options.ratio!r}: choose one of {', '.join(RATIOS)}")
    if options.kl_form not in KL_FORMS:
        raise ValueError(f"objective.grpo.kl_form={options.kl_form!r}: choose one of {', '.join(KL_FORMS)}")
    if options.ratio_norm and (options.ratio != "sample" or options.lambda_control or options.logprob_form != "gaussian"):
        raise ValueError("objective.grpo.ratio_norm=True (GRPO-Guard) normalises the per-sample Gaussian log-ratio: it needs "
                         "ratio='sample', lambda_control=False and sampler.logprob_form='gaussian'")
    kinds = AFFINE_KINDS if options.lambda_control else ("sde", "cps", "lc")
    if sampler.kind not in kinds:
        raise ValueError(f"sampler.kind={sampler.kind!r} cannot be trained on by objective 'grpo'"
                         f"{' with lambda_control' if options.lambda_control else ''}; choose one of {', '.join(kinds)}")


def offers(options) -> frozenset:
    """What credit schemes may rely on: per-step ratios, and per-token ones with `ratio="token"`."""
    return frozenset({"step", "token"} if options.ratio == "token" else {"step"})


def slots(options, levels: np.ndarray) -> np.ndarray:
    """The trained steps: the SDE window's (noise level > 0)."""
    return np.flatnonzero(np.asarray(levels))


def pairs(data: IterationData, rows, slots, weight, key, options) -> Minibatch:
    """`gather_pairs` on the iteration's data (the objectives' shared signature)."""
    return gather_pairs(data.rollout, data.schedule, data.adv, data.cond, data.null, rows, slots, weight)


def gather_pairs(ro: Rollout, schedule: Schedule, adv, cond, null_cond, rows, steps, weight) -> Minibatch:
    """The minibatch of pairs `(rows[m], steps[m])` of rollout `ro` drawn on `schedule`; `adv [B, T or 1, K]`, `cond` and
    `null_cond` batch-leading pytrees of the rollout's B samples."""
    take = lambda a: a[rows, steps]  # noqa: E731
    adv_t = adv[rows, jnp.minimum(steps, adv.shape[1] - 1)]
    pick = lambda tree: jax.tree_util.tree_map(lambda a: a[rows], tree)  # noqa: E731
    sigmas, levels = schedule.sigmas, schedule.levels
    return Minibatch(
        pairs={"x": take(ro.states), "x_next": take(ro.next_states), "mean_old": take(ro.means), "std": take(ro.stds),
               "logp_old": take(ro.logp), "x0_hat": take(ro.x0_hat), "sigma": sigmas[steps], "sigma_next": sigmas[steps + 1],
               "level": levels[steps], "step": steps, "adv": adv_t, "cond": pick(cond), "null": pick(null_cond), "weight": weight},
        shared={"sigma_1": sigmas[1], "all_sigmas": sigmas, "all_levels": levels})


def _per_step(values, weight, steps, num_steps):
    """Weighted mean and std of `values [M]` per step -> ([T], [T]) (NaN-free: empty steps give 0)."""
    w = jax.ops.segment_sum(weight, steps, num_steps)
    mean = jax.ops.segment_sum(weight * values, steps, num_steps) / jnp.maximum(w, 1e-8)
    var = jax.ops.segment_sum(weight * jnp.square(values - mean[steps]), steps, num_steps) / jnp.maximum(w, 1e-8)
    return mean, jnp.sqrt(var)


def path_variance(mean, mean_old, std, patch_size: int):
    """Measured `V` per token `[M, N]`: `mean_e (mu - mu_old)^2 / std^2` over each token's elements (0 where
    std = 0); the per-sample V is its token mean."""
    s = kernels.column(jnp.where(std > 0, std, 1.0), mean)
    v_tok = patchify(jnp.square(mean - mean_old) / s**2, patch_size).mean(-1)
    return jnp.where((std > 0)[:, None], v_tok, 0.0)


def step_cost(kind: str, sigma, sigma_next, level, sigma_1):
    """kappa = c_v^2 / std^2 (docs/math.md §4), same shape as `sigma`; inf where the step is deterministic."""
    _, c_v, std = kernels.affine_coefficients(kind, sigma, sigma_next, level, sigma_1)
    return jnp.where(std > 0, jnp.square(c_v) / jnp.where(std > 0, jnp.square(std), 1.0), jnp.inf)


def effort_weights(kind: str, mb: Minibatch):
    """[M] `w_t = (1 / kappa_t) / mean_u (1 / kappa_u)`, u over the rollout's trained steps."""
    sig, levels = mb["all_sigmas"], mb["all_levels"]
    inv_all = 1.0 / step_cost(kind, sig[:-1], sig[1:], levels, mb["sigma_1"])
    trained = levels > 0
    mean_inv = jnp.sum(jnp.where(trained, inv_all, 0.0)) / jnp.maximum(trained.sum(), 1)
    return (1.0 / step_cost(kind, mb["sigma"], mb["sigma_next"], mb["level"], mb["sigma_1"])) / mean_inv


def alignment(adv, log_ratio, weight):
    """Weighted Pearson correlation over pairs of the advantage `adv [M]` and the log-ratio `log_ratio [M]`
    (log pi_theta - log pi_old), `weight [M]`; 0 when either is constant (the first, on-policy minibatch).
    On pairs that no update has seen yet it says whether the updates so far moved the policy toward the
    advantages (+1) or at random (about 0, within `1 / sqrt(M)`)."""
    total = jnp.maximum(weight.sum(), 1e-8)
    center = lambda a: a - jnp.sum(weight * a) / total  # noqa: E731
    a, r = center(adv), center(log_ratio)
    cov, var_a, var_r = (jnp.sum(weight * u * v) for u, v in ((a, r), (a, a), (r, r)))
    return jnp.where((var_a > 0) & (var_r > 0), cov / jnp.sqrt(jnp.maximum(var_a * var_r, 1e-30)), 0.0)


def clipped_loss(trees: ParamTrees, mb: Minibatch, fns, options) -> tuple[jax.Array, dict]:
    """-> (loss, aux) for `options` with fields clip_range, beta, ratio, kl_form, lambda_control, patch_size,
    logprob_form, num_steps, kernel, ratio_norm (module doc); `lambda_control` adds docs/math.md §4's (i)-(iv), `ratio_norm` GRPO-Guard's."""
    lambda_control, ratio_norm = bool(options.lambda_control), bool(options.ratio_norm)
    affine = options.kernel != "lc"
    if lambda_control and not affine:
        raise ValueError("lambda-controlled GRPO needs an affine kernel (sampler.kind sde or cps), not lc")
    chex.assert_rank([mb["x"], mb["x_next"], mb["logp_old"], mb["adv"], mb["weight"]], [4, 4, 2, 2, 1])
    chex.assert_equal_shape([mb["x"], mb["x_next"], mb["mean_old"]])
    mean, std, v = fns.mean(trees.policy, mb)
    l_new = kernels.token_logprob(mb["x_next"], mean, std, options.patch_size, options.logprob_form)  # [M, N]
    w = mb["weight"]
    adv = mb["adv"]
    v_tok = path_variance(mean, mb["mean_old"], std, options.patch_size)  # [M, N]
    v_pair = v_tok.mean(-1)
    if options.ratio == "sample":
        log_ratio = (l_new.mean(-1) - mb["logp_old"].mean(-1))[:, None]  # [M, 1]
        adv = adv.mean(-1, keepdims=True)
        v_ratio = v_pair[:, None]
    else:
        log_ratio = l_new - mb["logp_old"]  # [M, N]
        adv = jnp.broadcast_to(adv, log_ratio.shape)
        v_ratio = v_tok
    eps = options.clip_range
    budget = eps**2 * mean[0].size  # lambda D
    v_step, _ = _per_step(v_pair, w, mb["step"], options.num_steps)
    if lambda_control:
        log_ratio = log_ratio + jax.lax.stop_gradient(v_ratio) / 2
    if ratio_norm:  # GRPO-Guard's RatioNorm (module doc); std = 0 (ODE) pairs have weight 0
        log_ratio = (log_ratio + v_ratio / 2) * std[:, None]
    ratio = jnp.exp(log_ratio)
    per_pair = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1 - eps, 1 + eps)).mean(-1)  # [M]
    if ratio_norm:  # and its reweighting across steps, 1 / |dt|
        per_pair = per_pair / (mb["sigma"] - mb["sigma_next"])
    in_budget = jnp.ones_like(w)
    if lambda_control:
        in_budget = (jax.lax.stop_gradient(v_step)[mb["step"]] <= budget).astype(w.dtype)
        per_pair = per_pair * effort_weights(options.kernel, mb) * in_budget
    total_w = jnp.maximum(w.sum(), 1.0)
    policy_loss = jnp.sum(w * per_pair) / total_w

    kl = jnp.zeros(())
    if options.beta > 0:
        ref_mean, _, _ = fns.mean(trees.reference, mb)
        ref_mean = jax.lax.stop_gradient(ref_mean)
        kl_std = std if options.kl_form == "exact" else std / jnp.sqrt(mb["sigma"] - mb["sigma_next"])
        kl_std = kernels.column(jnp.where(std > 0, kl_std, 1.0), mean)
        kl_pair = jnp.mean(jnp.square(mean - ref_mean) / (2 * kl_std**2), axis=(1, 2, 3))
        kl = jnp.sum(w * kl_pair) / total_w
    loss = policy_loss + options.beta * kl

    if affine:  # the prediction from the kernel's coefficient and the velocity change
        v_old = (mb["x"] - mb["x0_hat"]) / kernels.column(mb["sigma"], mb["x"])
        kappa = step_cost(options.kernel, mb["sigma"], mb["sigma_next"], mb["level"], mb["sigma_1"])
        v_pred = jnp.where(std > 0, kappa, 0.0) * jnp.mean(jnp.square(v - v_old), axis=(1, 2, 3))
    else:
        v_pred = jnp.zeros_like(v_pair)
    clipped = (jnp.abs(ratio - 1) > eps).mean(-1)
    sample_ratio = jnp.exp(log_ratio.mean(-1))
    ratio_mean, ratio_std = _per_step(sample_ratio, w, mb["step"], options.num_steps)
    aux = {"policy_loss": policy_loss, "kl": kl, "clipfrac": jnp.sum(w * clipped) / total_w,
           "clipfrac_per_step": _per_step(clipped, w, mb["step"], options.num_steps)[0],
           "alignment": alignment(adv.mean(-1), jax.lax.stop_gradient(log_ratio.mean(-1)), w),
           "approx_kl": jnp.sum(w * 0.5 * jnp.square(log_ratio).mean(-1)) / total_w,
           "ratio_mean_per_step": ratio_mean, "ratio_std_per_step": ratio_std,
           "path_variance_per_step": v_step, "path_variance_pred_per_step": _per_step(v_pred, w, mb["step"], options.num_steps)[0],
           "path_variance_budget": jnp.asarray(budget, jnp.float32),
           "over_budget_fraction": jnp.sum(w * (1 - in_budget)) / total_w}
    return loss, aux
