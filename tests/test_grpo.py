"""Group advantages, the uniform credit scheme and the clipped objective (docs/math.md §2-§4) against
independent NumPy / jax.scipy computations."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.scipy.stats import norm
from ml_collections import ConfigDict

from flowrl_jax import credit as credit_lib
from flowrl_jax.credit import group
from flowrl_jax.objectives import grpo
from flowrl_jax.objectives.batch import ParamTrees
from flowrl_jax.sampling import kernels, rollout, schedule
from flowrl_jax.rl.policy import PolicyFns
from flowrl_jax.rl.minibatch import minibatches
from tests.conftest import gaussian_velocity


def test_group_advantages_against_numpy():
    r = np.array([0.1, 0.5, 0.9, 0.2, 0.2, 0.2, 1.0, 0.0], np.float32)
    g = np.array([0, 0, 0, 1, 1, 1, 2, 2])
    means = np.array([r[g == k].mean() for k in range(3)])
    np.testing.assert_allclose(group.group_advantages(r, g, 3, global_std=True), (r - means[g]) / (r.std() + 1e-4), rtol=1e-5)
    stds = np.array([r[g == k].std() for k in range(3)])
    expected = np.clip((r - means[g]) / (stds[g] + 1e-4), -5, 5)
    np.testing.assert_allclose(group.group_advantages(r, g, 3, global_std=False), expected, rtol=1e-5)
    outlier = np.zeros(30, np.float32)
    outlier[0] = 1.0  # one success in a group of 30: z = sqrt(29) > 5, clipped
    a = group.group_advantages(outlier, np.zeros(30, np.int32), 1, global_std=False)
    assert float(a[0]) == 5.0 and abs(float(a[1]) + 1 / np.sqrt(29)) < 1e-3


def test_per_group_std_equals_flow_grpos_tracker_and_mixgrpos_group_code():
    """`advantage.global_std=False` as GRPO-Guard's configs run flow_grpo's `PerPromptStatTracker` (numpy population std
    per prompt + 1e-4, `stat_tracking.py` lines 25-31), and `std_ddof=1, std_eps=1e-8` as MixGRPO's `train_grpo_flux.py`
    (lines 447-449: `group_rewards.std() + 1e-8`, torch's unbiased std), both written out per group in float64."""
    rng = np.random.default_rng(0)
    r = rng.uniform(0, 1, 24).astype(np.float32)
    g = np.repeat(np.arange(4), 6)
    tracker = np.zeros(24)
    mix = np.zeros(24)
    for k in range(4):
        group_r = r[g == k].astype(np.float64)
        tracker[g == k] = (group_r - group_r.mean()) / (np.std(group_r) + 1e-4)
        mix[g == k] = (group_r - group_r.mean()) / (group_r.std(ddof=1) + 1e-8)
    # float32 means and stds of 6 values in [0, 1] (a few roundings each, ~1e-7 relative) against float64, then a
    # quotient: <= 1e-6 relative, so 1e-5 (a population vs sample std, sqrt(6/5) = 1.095, is 9.5% off)
    np.testing.assert_allclose(group.group_advantages(r, g, 4, global_std=False), tracker, rtol=1e-5, atol=1e-6)  # float32 mean/std/quotient ~1e-6 (above)
    np.testing.assert_allclose(group.group_advantages(r, g, 4, global_std=False, eps=1e-8, ddof=1), mix, rtol=1e-5, atol=1e-6)  # as above


def test_uniform_credit_and_dropping_all_zero_samples():
    r = jnp.array([0.3, 0.3, 0.1, 0.9])  # group 0 has no spread: its samples carry no signal
    sched = rollout.Schedule(schedule.sigmas(4, 1.0), rollout.noise_levels(4, 0.7, (1, 2)))
    credit = credit_lib.build(("uniform",), ConfigDict())
    adv, _ = credit.apply({"rollout": rollout.Rollout(*[None] * 6), "schedule": sched, "rewards": r, "group_ids": jnp.array([0, 0, 1, 1]),
                           "num_groups": 2}, credit.init())
    a = group.group_advantages(r, jnp.array([0, 0, 1, 1]), 2)
    assert adv.shape == (4, 4, 1)
    np.testing.assert_allclose(adv, jnp.broadcast_to(a[:, None, None], (4, 4, 1)))
    np.testing.assert_array_equal(credit_lib.kept_samples(adv, sched.trained), [False, False, True, True])
    with pytest.raises(ValueError, match="unknown credit scheme"):
        credit_lib.build(("uniform", "nope"), ConfigDict())


def test_minibatches_cover_each_kept_pair_once_with_padding():
    keep = np.array([True, False, True, True])
    chunks = list(minibatches(keep, np.array([1, 2]), size=4, rng=np.random.default_rng(0)))
    pairs = [(r, s) for rows, steps, w in chunks for r, s, wt in zip(rows, steps, w) if wt > 0]
    assert sorted(pairs) == [(0, 1), (0, 2), (2, 1), (2, 2), (3, 1), (3, 2)]
    assert [len(c[0]) for c in chunks] == [4, 4] and chunks[-1][2].tolist() == [1, 1, 0, 0]


# ---------------------------------------------------------------------------------- the objective
SIGMAS = schedule.sigmas(6, 1.0)
LEVELS = rollout.noise_levels(6, 0.7)


def _setup(kind="sde", b=6, seed=0):
    """A rollout of a 'policy' whose velocity is the exact Gaussian one scaled by theta (a scalar param)."""
    base = gaussian_velocity(0.3, 0.6)
    velocity_of = lambda theta: (lambda x, s: theta * base(x, s))  # noqa: E731
    x_T = jax.random.normal(jax.random.PRNGKey(seed), (b, 4, 4, 2))
    ro = rollout.rollout(velocity_of(1.0), x_T, SIGMAS, LEVELS, jax.random.PRNGKey(seed + 1), kind, patch_size=2)

    def mean_fn(theta, mb):
        return kernels.transition(kind, velocity_of(theta), mb["x"], mb["sigma"], mb["sigma_next"], mb["level"], mb["sigma_1"])

    rows, steps = (a.ravel().astype(np.int32) for a in np.meshgrid(np.arange(b), np.arange(6), indexing="ij"))
    adv = jax.random.normal(jax.random.PRNGKey(seed + 2), (b, 1, 1))
    cond = jnp.zeros((b, 1))
    mb = grpo.gather_pairs(ro, rollout.Schedule(SIGMAS, LEVELS), adv, cond, cond, rows, steps, np.ones(len(rows), np.float32))
    return ro, mb, mean_fn, adv


def _options(**kw):
    return ConfigDict(dict(dict(clip_range=0.01, beta=0.04, ratio="sample", kl_form="exact", lambda_control=False, patch_size=2,
                                logprob_form="gaussian", num_steps=6, kernel="sde", ratio_norm=False), **kw))


def test_uniform_per_sample_loss_reproduces_flow_grpo():
    ro, mb, mean_fn, adv = _setup()
    theta, eps, beta = 1.05, 0.01, 0.04
    loss, aux = grpo.clipped_loss(ParamTrees(theta, 1.0), mb, PolicyFns(mean_fn, None, None), _options())
    # Flow-GRPO written out: per-sample log-prob = mean over all elements of norm.logpdf
    mean, std, _ = mean_fn(theta, mb)
    s = np.asarray(std)[:, None, None, None]
    logp = norm.logpdf(mb["x_next"], mean, s).mean(axis=(1, 2, 3))
    ratio = np.exp(logp - np.asarray(mb["logp_old"]).mean(-1))
    a = np.asarray(mb["adv"])[:, 0]
    policy = np.mean(np.maximum(-a * ratio, -a * np.clip(ratio, 1 - eps, 1 + eps)))
    ref_mean, _, _ = mean_fn(1.0, mb)
    kl = np.mean(np.mean((np.asarray(mean) - np.asarray(ref_mean)) ** 2, axis=(1, 2, 3)) / (2 * np.asarray(std) ** 2))
    np.testing.assert_allclose(loss, policy + beta * kl, rtol=2e-4)
    np.testing.assert_allclose(aux["clipfrac"], np.mean(np.abs(ratio - 1) > eps), atol=1e-6)
    assert 0 < float(aux["clipfrac"]) < 1 and float(aux["kl"]) > 0



def test_grpo_guard_ratio_norm_is_the_noise_projection_of_the_mean_change_divided_by_dt():
    # GRPO-Guard's RatioNorm written another way: with x' = mu_old + std eps (the rollout's own noise),
    # (dl + mean_e dmu^2 / (2 std^2)) std = mean_e eps dmu exactly, so the ratio is exp(mean_e eps dmu), computed here in
    # float64 from the rollout's states and the two kernel means, without any log-density; each term is divided by |dt|.
    ro, mb, mean_fn, adv = _setup()
    theta, eps = 1.3, 2e-4
    loss, aux = grpo.clipped_loss(ParamTrees(theta, 1.0), mb, PolicyFns(mean_fn, None, None), _options(beta=0.0, clip_range=eps, ratio_norm=True))
    mean, std, _ = mean_fn(theta, mb)
    std64 = np.asarray(mb["std"], np.float64)[:, None, None, None]
    noise = (np.asarray(mb["x_next"], np.float64) - np.asarray(mb["mean_old"], np.float64)) / std64
    log_rho = np.mean(noise * (np.asarray(mean, np.float64) - np.asarray(mb["mean_old"], np.float64)), axis=(1, 2, 3))
    rho, a = np.exp(log_rho), np.asarray(mb["adv"], np.float64)[:, 0]
    dt = np.asarray(mb["sigma"] - mb["sigma_next"], np.float64)
    expected = np.mean(np.maximum(-a * rho, -a * np.clip(rho, 1 - eps, 1 + eps)) / dt)
    # Tolerance, from the float32 path's roundings (u = 2^-24): each element's log-density (<= 6 ops on values <= 2M, M the
    # largest |log-density| of the pair, computed below in float64) is off by <= 12 M u, the mean over the pair's elements
    # (token means, then their mean: <= 7 roundings of values <= M) adds 7 M u, for l_theta and l_old each, and their
    # difference 1 M u: |error of dl| <= 39 M u; the dmu^2 term is ~1e-6 of M. Times std (1 rounding) and exp (1): per pair
    # |error of rho| <= e = (39 std M + 2) u. The loss is the mean of |a| rho / dt terms: error <= mean(|a| / dt e (1 + eps))
    # plus the mean's own rounding (6 u of the largest term).
    u = 2.0**-24
    densities = [norm.logpdf(np.asarray(mb["x_next"], np.float64), np.asarray(m, np.float64), std64) for m in (mean, mb["mean_old"])]
    big = np.max([np.abs(d).max(axis=(1, 2, 3)) for d in densities], axis=0)  # M per pair
    e = (39 * np.asarray(mb["std"], np.float64) * big + 2) * u
    terms = np.maximum(-a * rho, -a * np.clip(rho, 1 - eps, 1 + eps)) / dt
    atol = float(np.mean(np.abs(a) / dt * e * (1 + eps)) + 6 * u * np.abs(terms).max())
    np.testing.assert_allclose(float(loss), expected, atol=atol)
    # Clipping: every pair sits farther than its rounding bound e from the clip boundary, so float32 and float64 agree on
    # each pair, and the clipped fraction (k / 36 in float32) is compared exactly as a count.
    clipped = np.abs(rho - 1) > eps
    assert np.min(np.abs(np.abs(rho - 1) - eps) - e) > 0, "a pair within rounding of the clip boundary: pick another case"
    assert round(float(aux["clipfrac"]) * len(rho)) == int(clipped.sum())
    assert 0 < float(aux["clipfrac"]) < 1  # both branches of the clip are exercised
    plain, _ = grpo.clipped_loss(ParamTrees(theta, 1.0), mb, PolicyFns(mean_fn, None, None), _options(beta=0.0, clip_range=eps))
    assert abs(float(plain) - expected) > 100 * atol  # the normalisation is not a no-op on this case


@pytest.mark.parametrize("ratio", ["sample", "token"])
def test_on_policy_ratio_is_one_and_the_loss_is_minus_the_mean_advantage(ratio):
    ro, mb, mean_fn, adv = _setup(kind="cps")
    loss, aux = grpo.clipped_loss(ParamTrees(1.0, 1.0), mb, PolicyFns(mean_fn, None, None), _options(ratio=ratio, kernel="cps"))
    np.testing.assert_allclose(aux["ratio_mean_per_step"], 1.0, atol=2e-5)
    np.testing.assert_allclose(aux["ratio_std_per_step"], 0.0, atol=2e-5)
    assert float(aux["clipfrac"]) == 0.0 and float(aux["kl"]) == 0.0 and float(aux["approx_kl"]) < 1e-10
    np.testing.assert_allclose(loss, -np.mean(np.asarray(mb["adv"])), rtol=1e-4)


def test_kl_is_the_gaussian_kl_and_the_flow_grpo_form_drops_sqrt_dt():
    ro, mb, mean_fn, _ = _setup()
    _, aux = grpo.clipped_loss(ParamTrees(1.1, 1.0), mb, PolicyFns(mean_fn, None, None), _options(beta=1.0))
    _, aux_compat = grpo.clipped_loss(ParamTrees(1.1, 1.0), mb, PolicyFns(mean_fn, None, None), _options(beta=1.0, kl_form="flow_grpo"))
    # the closed-form KL(N(m1, s1^2) || N(m2, s2^2)) per element, averaged like the objective
    mean, std, _ = mean_fn(1.1, mb)
    ref, _, _ = mean_fn(1.0, mb)
    s1 = s2 = np.asarray(std, np.float64)[:, None, None, None]
    closed = np.log(s2 / s1) + (s1**2 + (np.asarray(mean, np.float64) - np.asarray(ref, np.float64)) ** 2) / (2 * s2**2) - 0.5
    np.testing.assert_allclose(aux["kl"], closed.mean(), rtol=1e-3)
    dt = np.asarray(mb["sigma"] - mb["sigma_next"])
    per_pair = np.mean((np.asarray(mean) - np.asarray(ref)) ** 2, axis=(1, 2, 3)) / (2 * np.asarray(std) ** 2)
    np.testing.assert_allclose(aux_compat["kl"], np.mean(per_pair * dt), rtol=1e-4)


def test_token_ratio_with_token_constant_advantage_has_the_per_sample_gradient_on_policy():
    # On policy, d/dtheta mean_k(rho_k A) = A d/dtheta mean_k l_k = the per-sample ratio's gradient.
    ro, mb, mean_fn, _ = _setup()
    g_sample = jax.grad(lambda th: grpo.clipped_loss(ParamTrees(th, 1.0), mb, PolicyFns(mean_fn, None, None), _options(beta=0.0))[0])(1.0)
    g_token = jax.grad(lambda th: grpo.clipped_loss(ParamTrees(th, 1.0), mb, PolicyFns(mean_fn, None, None), _options(beta=0.0, ratio="token"))[0])(1.0)
    np.testing.assert_allclose(g_token, g_sample, rtol=1e-4)
    assert abs(float(g_sample)) > 0


# ------------------------------------------------------------------------ null control and diagnostics (issue 16)
def test_null_control_permutes_within_groups_uniformly_and_zeroes_the_expected_gradient():
    g = jnp.array([2, 0, 0, 2, 1, 0, 2, 1, 0])  # groups need not be contiguous
    a = group.group_advantages(jnp.arange(9.0) ** 1.5, g, 3, global_std=False)
    perms = jax.vmap(lambda k: group.permute_within_groups(a, g, k))(jax.random.split(jax.random.PRNGKey(0), 4000))
    for k in range(3):  # each group keeps its own values
        np.testing.assert_allclose(np.sort(np.asarray(perms)[:, np.asarray(g) == k], 1),
                                   np.broadcast_to(np.sort(np.asarray(a)[np.asarray(g) == k]), (4000, int((g == k).sum()))),
                                   rtol=1e-6)  # the same float32 values moved, not recomputed: equal up to nothing
    # Uniform over the 4! orders of group 0's rows: each order's frequency within 4 binomial standard errors of 1/24.
    rows0 = np.flatnonzero(np.asarray(g) == 0)
    order = np.argsort(np.argsort(np.asarray(perms)[:, rows0], 1), 1) @ (4 ** np.arange(4))
    freq = np.unique(order, return_counts=True)[1] / 4000
    assert len(freq) == 24 and np.all(np.abs(freq - 1 / 24) < 4 * np.sqrt(1 / 24 * 23 / 24 / 4000))
    # The on-policy policy gradient -mean_i A_i grad l_i of a toy log-prob l_i(theta) = -(x_i - theta_i)^2 / 2, each
    # sample its own direction: unpermuted it is far from 0; over the permutations its mean is 0 within 4 standard errors.
    x = jnp.linspace(-1.0, 1.0, 9)
    grad = lambda adv: jax.grad(lambda th: -jnp.mean(adv * -0.5 * (x - th) ** 2))(jnp.zeros(9))  # noqa: E731
    null = jax.vmap(grad)(perms)
    se = np.asarray(null.std(0)) / np.sqrt(4000)
    assert np.all(np.abs(np.asarray(null.mean(0))) < 4 * se + 1e-7)
    assert np.max(np.abs(np.asarray(grad(a)))) > 20 * se.max()


def test_alignment_is_one_on_aligned_log_ratios_and_about_zero_on_noise():
    adv = jax.random.normal(jax.random.PRNGKey(0), (4000,))
    w = jnp.ones(4000).at[-100:].set(0.0)  # padding pairs do not count
    aligned = jnp.where(w > 0, 3e-5 * adv, 7.0)
    np.testing.assert_allclose(grpo.alignment(adv, aligned, w), 1.0, atol=1e-5)  # float32 sums of 4k terms
    np.testing.assert_allclose(grpo.alignment(adv, -aligned, w), -1.0, atol=1e-5)  # float32 sums of 4k terms (above)
    noise = jax.random.normal(jax.random.PRNGKey(1), (4000,))
    assert abs(float(grpo.alignment(adv, noise, w))) < 4 / np.sqrt(3900)  # 4 standard errors of a null correlation
    assert float(grpo.alignment(adv, jnp.zeros(4000), w)) == 0.0  # the first (on-policy) minibatch


def test_minibatches_keep_each_samples_pairs_together():
    keep = np.ones(12, bool)
    chunks = list(minibatches(keep, np.array([0, 3, 5]), size=9, rng=np.random.default_rng(1)))
    rows = np.concatenate([c[0] for c in chunks])
    assert [set(np.asarray(c[0])) for c in chunks] == [set(rows[i:i + 9]) for i in range(0, 36, 9)]
    assert all(len(set(c[0].tolist())) == 3 for c in chunks)  # 9 pairs = 3 samples x 3 steps, nothing split
    assert sorted(rows.tolist()) == sorted(list(range(12)) * 3)


def test_detached_unconditional_branch_takes_the_gradient_of_the_conditional_one_only():
    x, sigma, cfg = jnp.ones((2, 2)), jnp.full((2,), 0.5), 3.0
    fn = lambda th: (lambda xx, s, c: th * c * xx)  # noqa: E731  v = theta * cond * x
    cond, null = jnp.full((2, 1), 2.0), jnp.full((2, 1), 0.5)
    value = lambda th, detach: rollout.guided(fn(th), cond, null, cfg, detach)(x, sigma).sum()  # noqa: E731
    np.testing.assert_allclose(value(1.3, True), value(1.3, False), rtol=1e-6)  # the same velocity, float32 rounding
    # v = (1 - cfg) theta u x + cfg theta c x: d/dtheta sums to 4 ((1 - cfg) 0.5 + cfg 2) in full, 4 cfg 2 detached.
    np.testing.assert_allclose(jax.grad(value)(1.3, False), 4 * ((1 - cfg) * 0.5 + cfg * 2.0), rtol=1e-6)  # 4-term float32 sums
    np.testing.assert_allclose(jax.grad(value)(1.3, True), 4 * cfg * 2.0, rtol=1e-6)  # 4-term float32 sums


def _guard_upstream_torch(torch, params, params_old, x, x_next, sigmas, levels, cond, null, adv, cfg, eps, adv_clip=5.0):
    """flow_grpo's `scripts/train_sd3_GRPO_Guard.py` (upstream 9745241) written out in torch float64, the toy velocity
    `v(x, sigma, c) = c x W + sigma (1 - c) b` standing in for the transformer. Per timestep j of the rollout:
    `compute_log_prob` (L181-195: one batched forward on `cat([x] * 2)` with the negative condition first, both halves with
    gradients, `v_u + cfg (v_c - v_u)`), `sde_step_with_logprob` (sd3_sde_with_logprob.py L50-74, "sde"), RatioNorm
    (L915-919), the clamped advantage and the clip (L920-927), `/ sqrt_dt.mean()**2` (L931-932); the batch mean per
    timestep, and accelerate's accumulation over the timesteps (a mean). -> (loss, per-pair terms [T, B], ratios [T, B], |log-density| [T, B])."""
    f64 = lambda a: torch.tensor(np.array(a, np.float64))  # noqa: E731
    x, x_next, cond, null, adv = (f64(a) for a in (x, x_next, cond, null, adv))
    sigma_max = float(sigmas[1])

    def velocity(p, xx, sigma, c):
        c4 = c[:, :, None, None]
        return c4 * xx @ p["w"] + sigma * (1 - c4) * p["b"]

    def step(p, j):
        sigma, nxt, a = float(sigmas[j]), float(sigmas[j + 1]), float(levels[j])
        xx = x[:, j]
        v = velocity(p, torch.cat([xx] * 2), sigma, torch.cat([null, cond]))
        v_u, v_c = v.chunk(2)
        v = v_u + cfg * (v_c - v_u)
        dt = nxt - sigma
        std_dev_t = math.sqrt(sigma / (1 - (sigma_max if sigma == 1 else sigma))) * a
        mean = xx * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
        s = std_dev_t * math.sqrt(-dt)
        logp = (-((x_next[:, j] - mean) ** 2) / (2 * s**2) - math.log(s) - math.log(math.sqrt(2 * math.pi))).mean(dim=(1, 2, 3))
        return mean, logp, std_dev_t, math.sqrt(-dt)

    terms, ratios, densities = [], [], []
    for j in range(len(levels) - 1):  # num_train_timesteps = int(T * 0.99): the last step is not trained
        with torch.no_grad():
            mean_old, logp_old, _, _ = step(params_old, j)  # the rollout's stored prev_sample_mean and log_probs
        mean, logp, sigma_t, sqrt_dt = step(params, j)
        bias = (mean - mean_old).pow(2).mean(dim=(1, 2, 3)) / (2 * (sqrt_dt * sigma_t) ** 2)
        ratio = torch.exp((logp - logp_old + bias) * (sqrt_dt * sigma_t))
        a = torch.clamp(adv, -adv_clip, adv_clip)
        terms.append(torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - eps, 1 + eps)) / sqrt_dt**2)
        ratios.append(ratio.detach())
        densities.append(torch.maximum(logp.detach().abs(), logp_old.abs()))
    terms = torch.stack(terms)
    return terms.mean(), terms, torch.stack(ratios).numpy(), torch.stack(densities).numpy()


def test_grpo_guard_gradient_with_the_cfg_branch_live_equals_a_torch_transcription_of_upstream():
    """GRPO-Guard at CFG 4.5 with gradients through both CFG branches (`detach_uncond=False`, upstream's default): the
    loss and its gradient against the torch float64 transcription above, at shift 3 (1/|dt| not a constant). Ours runs
    under x64 on the same rollout (states, next states) and parameters."""
    torch = pytest.importorskip("torch")
    b, cfg, eps = 4, 4.5, 2e-3
    sigmas = np.asarray(schedule.sigmas(6, 3.0), np.float64)
    levels = np.full(6, 0.7)
    rng = np.random.default_rng(0)
    p_old = {"w": np.eye(2) * -0.8 + 0.1 * rng.standard_normal((2, 2)), "b": rng.standard_normal(2)}
    p_new = {k: v + 0.02 * rng.standard_normal(v.shape) for k, v in p_old.items()}
    cond, null = rng.uniform(0.5, 1.5, (b, 1)), np.full((b, 1), 0.2)  # the null condition reaches w and b both
    adv = rng.standard_normal(b)

    def fn(p):
        return lambda x, s, c: c[:, :, None, None] * x @ p["w"] + s[:, None, None, None] * (1 - c[:, :, None, None]) * p["b"]

    with jax.enable_x64(True):
        j64 = lambda tree: jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), tree)  # noqa: E731
        x_T = jax.random.normal(jax.random.PRNGKey(1), (b, 4, 4, 2), jnp.float64)
        ro = rollout.rollout(rollout.guided(fn(j64(p_old)), jnp.asarray(cond), jnp.asarray(null), cfg), x_T, jnp.asarray(sigmas),
                             jnp.asarray(levels), jax.random.PRNGKey(2), "sde", patch_size=2)
        rows, steps = (a.ravel().astype(np.int32) for a in np.meshgrid(np.arange(b), np.arange(5), indexing="ij"))  # steps 0-4
        mb = grpo.gather_pairs(ro, rollout.Schedule(jnp.asarray(sigmas), jnp.asarray(levels)), jnp.asarray(adv)[:, None, None],
                               jnp.asarray(cond), jnp.asarray(null), rows, steps, np.ones(len(rows)))

        def loss_of(detach):
            def mean_fn(p, mb):
                v = rollout.guided(fn(p), mb["cond"], mb["null"], cfg, detach)
                return kernels.transition("sde", v, mb["x"], mb["sigma"], mb["sigma_next"], mb["level"], mb["sigma_1"])
            opts = _options(beta=0.0, clip_range=eps, ratio_norm=True)
            return lambda p: grpo.clipped_loss(ParamTrees(p, None), mb, PolicyFns(mean_fn, None, None), opts)[0]

        loss, grad = jax.value_and_grad(loss_of(False))(j64(p_new))
        grad_detached = jax.grad(loss_of(True))(j64(p_new))
        x, x_next = np.asarray(ro.states), np.asarray(ro.next_states)

    tp = {k: torch.tensor(v, requires_grad=True) for k, v in p_new.items()}
    t_old = {k: torch.tensor(v) for k, v in p_old.items()}
    t_loss, terms, ratios, big = _guard_upstream_torch(torch, tp, t_old, x, x_next, sigmas, levels, cond, null, adv, cfg, eps)
    t_loss.backward(retain_graph=True)  # the per-pair gradients below reuse the graph
    # Both sides float64 (u = 1.1e-16). The RatioNorm log-ratio is the difference of two mean log-densities of size
    # M <= 20 (asserted) times std < 1: its absolute error is <= ~40 M u = 1e-13, so each pair's ratio, term and gradient
    # carry a relative error <= 1e-12 (the few dozen further operations add ~1e-14). The total's error is then <= 1e-12
    # times the sum of the 20 pairs' magnitudes, taken from the transcription's per-pair gradients (`scale`).
    assert big.max() <= 20
    per_pair = [torch.autograd.grad(t, list(tp.values()), retain_graph=True) for t in terms.reshape(-1)]
    for i, name in enumerate(tp):
        scale = float(sum(np.abs(g[i].numpy()) for g in per_pair).max())
        np.testing.assert_allclose(np.asarray(grad[name]), tp[name].grad.numpy(), rtol=0, atol=1e-12 * scale)  # float64 (above)
        # the unconditional branch has weight 1 - cfg = -3.5: detaching it moves the gradient far outside that bound
        assert np.abs(np.asarray(grad_detached[name]) - tp[name].grad.numpy()).max() > 1e6 * 1e-12 * scale
    np.testing.assert_allclose(float(loss), float(t_loss.detach()), rtol=0, atol=1e-12 * float(terms.detach().abs().mean()))  # float64 (above)
    # both branches of the clip are exercised, and no pair sits within rounding (1e-12) of the boundary
    clipped = np.abs(ratios - 1) > eps
    assert 0 < clipped.mean() < 1 and np.min(np.abs(np.abs(ratios - 1) - eps)) > 1e-9
