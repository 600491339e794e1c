"""Transition kernels (docs/math.md §1) against jax.scipy.stats, hand computations and a Monte Carlo law."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.scipy.stats import norm

from flowrl_jax.models.mmdit import patchify
from flowrl_jax.sampling import kernels, rollout, schedule
from tests.conftest import gaussian_marginal, gaussian_velocity

SIGMAS = schedule.sigmas(10, 3.0)
EPS = float(np.finfo(np.float32).eps)  # 1.19e-7
VELOCITY = gaussian_velocity(0.8, 0.5)


def _state(b=4, seed=0):
    return jax.random.normal(jax.random.PRNGKey(seed), (b, 8, 8, 3))


@pytest.mark.parametrize("kind", ["sde", "cps", "lc"])
def test_token_logprob_is_the_mean_of_norm_logpdf_over_each_token(kind):
    x = _state()
    mean, std, _ = kernels.transition(kind, VELOCITY, x, SIGMAS[3], SIGMAS[4], 0.7, SIGMAS[1])
    x_next = mean + std[:, None, None, None] * jax.random.normal(jax.random.PRNGKey(1), x.shape)
    l = kernels.token_logprob(x_next, mean, std, patch_size=4)
    ref = norm.logpdf(x_next, loc=mean, scale=std[:, None, None, None])
    # Every density here is < 0 (std >= 0.45, so -log std < 0.92), so a token's 12-term mean has no cancellation: the two
    # formulas (same squared residual, normalizer log(2 pi std^2) / 2 vs log std + log(2 pi) / 2) and their 11-term sums
    # each round <= 13 times, |diff| <= 13 eps |l| = 1.5e-6 |l|; rtol 1e-5 = 84 eps covers it 6x (atol adds nothing needed).
    np.testing.assert_allclose(l, patchify(ref, 4).mean(-1), rtol=1e-5, atol=1e-5)
    assert l.shape == (4, 4)
    # the per-sample log-prob (mean over tokens) is Flow-GRPO's mean over all elements
    # a 192-term mean against a 12- then 4-term mean, no cancellation: <= (191 + 11 + 3) eps/2 |l| + 2 eps |l| ~ 105 eps |l|
    # = 1.25e-5 |l| <= atol + rtol |l| for |l| < 4 (here 0.6-1.2)
    np.testing.assert_allclose(l.mean(-1), ref.mean(axis=(1, 2, 3)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["sde", "cps", "lc"])
def test_on_policy_ratio_is_exactly_one(kind):
    x_T = _state(seed=2)
    levels = rollout.noise_levels(10, 0.7)
    ro = rollout.rollout(VELOCITY, x_T, SIGMAS, levels, jax.random.PRNGKey(3), kind, patch_size=2)
    b, t = ro.states.shape[:2]
    flat = lambda a: a.reshape((b * t,) + a.shape[2:])  # noqa: E731
    steps = jnp.tile(jnp.arange(t), b)
    mean, std, _ = kernels.transition(kind, VELOCITY, flat(ro.states), SIGMAS[steps], SIGMAS[steps + 1],
                                      levels[steps], SIGMAS[1])
    l = kernels.token_logprob(flat(ro.next_states), mean, std, 2)
    # Same float32 formulas on the same x' on both sides; XLA's FMA fusion inside the scan moves the mean by <= 2 eps max|x|,
    # hence each log-density by |z| 2 eps max|x| / std (z = (x' - mean) / std; a token's mean |z| <= 2), plus each side's
    # rounding of a 12-term token mean of densities |d| <= 14 (std >= 0.006): <= (4 + 11) eps |d|. Per row (step):
    row_std = np.asarray(flat(ro.stds))[:, None]
    bound = EPS * (4 * float(jnp.abs(ro.next_states).max()) / np.where(row_std > 0, row_std, np.inf) + 15 * 14)
    # = 2-3e-4 on the step into sigma <= 0.009 (std ~ 0.006-0.008: x' is float32, so its residual is only known to
    # eps |x'| / std), ~3e-5 on the others; measured <= 7e-6 and <= 4e-7 (<= 2.3% of the bound). Deterministic steps
    # (std 0) carry l = logp = 0 exactly.
    assert np.all(np.abs(np.exp(l - flat(ro.logp)) - 1.0) <= bound), np.abs(np.exp(l - flat(ro.logp)) - 1.0).max()
    assert np.all(np.isfinite(ro.logp)) and np.all(ro.stds[:, :-1] > 0)


@pytest.mark.parametrize("kind", ["sde", "cps", "lc"])
def test_zero_noise_level_is_euler(kind):
    x = _state()
    for i in (0, 4, 8):
        mean, std, v = kernels.transition(kind, VELOCITY, x, SIGMAS[i], SIGMAS[i + 1], 0.0, SIGMAS[1])
        # sde and lc reduce to x + dt v bitwise; cps's coefficients equal (1, dt) to ~1 ulp (c_v = -sigma (1 - sigma') +
        # (1 - sigma) sigma', 4 roundings of terms <= 1/4), so |diff| <= eps (|x| + |v| / 2 + |mean| / 2) <= 7.5 eps = 9e-7
        # (|x| <= 3.3, |v| <= 4.8) < atol 1e-6. Measured 2.4e-7.
        np.testing.assert_allclose(mean, x + v * (SIGMAS[i + 1] - SIGMAS[i]), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(std, 0.0)
        l = kernels.token_logprob(mean, mean, std, 4)
        np.testing.assert_array_equal(l, 0.0)  # deterministic steps carry no log-prob


def test_sde_mean_and_std_match_a_hand_computation():
    # Flow-GRPO's sde_step_with_logprob written out with Python floats, a = 0.7, T = 10, shift 3.
    a, x, v = 0.7, 0.3, -1.2
    s = [float(u) for u in SIGMAS]
    for i in (0, 4, 8):
        sigma, nxt = s[i], s[i + 1]
        dt = nxt - sigma
        std_dev_t = math.sqrt(sigma / (1 - (s[1] if sigma == 1 else sigma))) * a
        mu = x * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
        mean, std, _ = kernels.transition("sde", lambda y, t: jnp.full_like(y, v), jnp.full((1, 1, 1, 1), x), sigma, nxt, a, s[1])
        # float32 against float64: <= 14 roundings (inputs 0.3, -1.2, 0.7 and ~11 ops) with no cancellation (both terms
        # of mu are > 0, std is a product and a sqrt): <= 7 eps = 8e-7 relative; rtol 1e-5 = 84 eps
        np.testing.assert_allclose(float(mean[0, 0, 0, 0]), mu, rtol=1e-5)
        np.testing.assert_allclose(float(std[0]), std_dev_t * math.sqrt(-dt), rtol=1e-5)


def _upstream_step(kind, x, v, sigma, nxt, a, sigma_max):
    """flow_grpo's `sde_step_with_logprob` (flow_grpo/diffusers_patch/sd3_sde_with_logprob.py at upstream 9745241,
    lines 50-74) written out in float64: -> (prev_sample_mean, the noise's std). `sde`: `std_dev_t = sqrt(sigma / (1 -
    sigma_safe)) a` scaled by `sqrt(-dt)`; `cps`: `std_dev_t = sigma_prev sin(a pi / 2)`, `x0 = x - sigma v`,
    `x1 = x + v (1 - sigma)`, mean `x0 (1 - sigma_prev) + x1 sqrt(sigma_prev^2 - std_dev_t^2)`."""
    x, v = np.asarray(x, np.float64), np.asarray(v, np.float64)
    dt = nxt - sigma
    if kind == "sde":
        std_dev_t = math.sqrt(sigma / (1 - (sigma_max if sigma == 1 else sigma))) * a
        mean = x * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
        return mean, std_dev_t * math.sqrt(-dt)
    std_dev_t = nxt * math.sin(a * math.pi / 2)
    x0, x1 = x - sigma * v, x + v * (1 - sigma)
    return x0 * (1 - nxt) + x1 * math.sqrt(nxt**2 - std_dev_t**2), std_dev_t


@pytest.mark.parametrize("kind", ["sde", "cps"])
def test_affine_coefficient_is_the_derivative_of_upstreams_mean_in_v(kind):
    # c_v (docs/math.md §4's path-variance coefficient) against the central difference of the float64 transcription above
    # (linear in v: the difference is exact up to float64 rounding, ~1e-13)
    s = [float(u) for u in SIGMAS]
    for i in (0, 4, 8):
        for a in (0.3, 0.7):
            h = 1e-3
            d = (_upstream_step(kind, 0.3, -1.2 + h, s[i], s[i + 1], a, s[1])[0] - _upstream_step(kind, 0.3, -1.2 - h, s[i], s[i + 1], a, s[1])[0]) / (2 * h)
            _, c_v, _ = kernels.affine_coefficients(kind, SIGMAS[i], SIGMAS[i + 1], a, SIGMAS[1])
            # c_v in float32 from <= 8 roundings of terms <= 1 (cps: two products and a sqrt): <= 8 eps relative, with
            # no cancellation for sde; cps's c_v = -sigma (1 - sigma') + (1 - sigma) rest may cancel to |c_v| ~ 0.1, so
            # absolute 8 eps x (terms <= 1) ~ 1e-6
            np.testing.assert_allclose(float(c_v), d, rtol=1e-5, atol=2e-6)  # <= 8 float32 roundings, cps may cancel (above)


@pytest.mark.parametrize("a", [0.3, 0.8])
def test_cps_mean_std_and_compat_logprob_equal_upstreams_at_a_positive_noise_level(a):
    """Flow-CPS (`sde_type == "cps"`) at noise level a > 0: the mean and std against the transcription above, and the
    published log-prob `-mean((x' - mu)^2)` over the sample's elements (no constants, no 1/(2 std^2)) against ours
    (`logprob_form="cps_compat"`, the token means' mean: equal-size tokens)."""
    s = [float(u) for u in SIGMAS]
    x = _state(2)
    v = jax.random.normal(jax.random.PRNGKey(3), x.shape)
    for i in (0, 3, 7):
        mean, std, _ = kernels.transition("cps", lambda y, t: v, x, SIGMAS[i], SIGMAS[i + 1], a, SIGMAS[1])
        ref_mean, ref_std = _upstream_step("cps", x, v, s[i], s[i + 1], a, s[1])
        # float32: x0, x1 (2 roundings each), two products and a sum (3 more), terms |.| <= 4 (|x|, |v| <= 4): <= 8 eps x 8
        # = 7.6e-6 absolute, with cancellation possible in the sum (so absolute, not relative)
        np.testing.assert_allclose(np.asarray(mean), ref_mean, rtol=0, atol=1e-5)  # 8 eps x terms <= 8 = 7.6e-6 (above)
        np.testing.assert_allclose(float(std[0]), ref_std, rtol=1e-6)  # sigma' sin(a pi / 2): 2 roundings (measured ~1e-7)
        z = np.asarray(jax.random.normal(jax.random.PRNGKey(4 + i), x.shape), np.float64)
        x_next = ref_mean + ref_std * z
        ref_logp = -np.mean((x_next - ref_mean) ** 2, axis=(1, 2, 3))  # upstream's log_prob.mean over non-batch dims
        ours = np.asarray(kernels.token_logprob(jnp.asarray(x_next, jnp.float32), mean, std, 4, "cps_compat")).mean(1)
        # |mu - mu64| <= 1e-5 (above) against |x' - mu| ~ std ~ 0.1-0.8: each square moves by <= 2 x 1e-5 / 0.1 relative,
        # and the mean of squares averages those: rtol 1e-3 (a wrong form, e.g. with 1 / (2 std^2), is O(1) off)
        np.testing.assert_allclose(ours, ref_logp, rtol=1e-3)  # |mu err| 1e-5 over |x' - mu| >= 0.1, squared (above)


def _w2_after_one_step(kind, a, i, n=1_000_000):
    """Gaussian W2 between one kernel step from the exact marginal at sigma_i and the exact marginal at
    sigma_{i+1}, for x0 ~ N(0.8, 0.5^2) (1-D, analytic velocity), by Monte Carlo."""
    sigma, nxt = SIGMAS[i], SIGMAS[i + 1]
    m, s = gaussian_marginal(0.8, 0.5, float(sigma))
    x = m + s * jax.random.normal(jax.random.PRNGKey(10), (n, 1, 1, 1))
    mean, std, _ = kernels.transition(kind, VELOCITY, x, sigma, nxt, a, SIGMAS[1])
    y = mean + std[:, None, None, None] * jax.random.normal(jax.random.PRNGKey(11), x.shape)
    m2, s2 = gaussian_marginal(0.8, 0.5, float(nxt))
    return math.hypot(float(y.mean()) - m2, float(y.std()) - s2)


def test_langevin_correction_moves_samples_toward_the_marginal():
    # docs/math.md §1: at a = 0.5 on the coarse step sigma .707 -> .602 (T = 10, shift 3) the Euler step's error
    # dominates and one Langevin step removes most of it (exact: Euler .0042, lc .0007).
    euler, lc = _w2_after_one_step("ode", 0.0, 5), _w2_after_one_step("lc", 0.5, 5)
    # Monte Carlo: n = 1e6 draws give each W2 estimate a standard error SE = 4.6e-4 (sd over 150 key pairs; ~ s' / sqrt(n)
    # = 6.3e-4 on the mean, 4.5e-4 on the std); with fixed keys the draws are CPU-independent and float32 reduction moves
    # an estimate by ~3e-8 (against float64). 0.0015 = 3.3 SE; 0.0025 = exact 0.0007 + 3.9 SE (E[lc] ~ 0.0010, hypot
    # bias); lc < 0.5 euler has a mean gap of 2.1 SE (sd 5.4e-4): at these keys 0.0010 vs 0.0023, i.e. 2.4 SE.
    assert abs(euler - 0.0042) < 0.0015 and lc < 0.0025 and lc < 0.5 * euler
    # at a = 0.7 lc beats the Flow-GRPO sde kernel early in the schedule (exact .0128 vs .0252)
    sigma, nxt = float(SIGMAS[5]), float(SIGMAS[6])
    a_same_std = 0.7 * nxt / math.sqrt(sigma / (1 - sigma) * (sigma - nxt))  # sde std == lc std (a sigma')
    assert _w2_after_one_step("lc", 0.7, 5) < 0.7 * _w2_after_one_step("sde", a_same_std, 5)  # gap 0.0048 = 10 SE
