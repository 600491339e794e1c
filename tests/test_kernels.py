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


@pytest.mark.parametrize("kind", ["sde", "cps"])
def test_affine_coefficient_is_the_derivative_of_the_mean_in_v(kind):
    # c_v (docs/math.md §4's path-variance coefficient) against jax.jacfwd of the kernel mean
    x = jnp.full((1, 1, 1, 1), 0.3)
    for i in (0, 4, 8):
        mean_of_v = lambda v: kernels.transition(kind, lambda y, t: v, x, SIGMAS[i], SIGMAS[i + 1], 0.7, SIGMAS[1])[0]  # noqa: E731
        d = jax.jacfwd(mean_of_v)(jnp.full((1, 1, 1, 1), -1.2)).reshape(())
        _, c_v, _ = kernels.affine_coefficients(kind, SIGMAS[i], SIGMAS[i + 1], 0.7, SIGMAS[1])
        # the mean is linear in v, so the tangent is c_v itself from the same ~6 float32 ops (FMA fusion aside: <= 3 eps)
        np.testing.assert_allclose(d, c_v, rtol=1e-5)


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
