"""Sigma schedule against docs/math.md's table, and the CFG ODE sampler against closed forms."""
import jax
import jax.numpy as jnp
import numpy as np

from flowrl_jax.sampling import rollout, schedule
from tests.conftest import gaussian_velocity


def test_schedule_matches_spec_table():
    # docs/math.md §0: T = 10, shift = 3 (diffusers' FlowMatchEulerDiscreteScheduler)
    expected = [1.0, .9601, .9133, .8577, .7904, .7073, .6022, .4649, .2780, .0089, 0.0]
    # the table is rounded to 4 decimals (<= 5e-5; measured 4.94e-5) and float32 adds a few eps of sigma <= 1 (< 1e-6)
    np.testing.assert_allclose(schedule.sigmas(10, 3.0), expected, rtol=0, atol=5e-5 + 1e-6)
    # float32 linspace against the exact values: <= 2 roundings of values <= 1, i.e. <= 2 eps = 2.4e-7 (measured 6e-8)
    np.testing.assert_allclose(schedule.sigmas(4, 1.0), [1.0, 2 / 3 + 1 / 3000, 1 / 3 + 2 / 3000, 0.001, 0.0], atol=1e-6)


def test_ode_transports_noise_to_the_gaussian_data_law():
    m, s = 0.8, 0.5
    x_T = jax.random.normal(jax.random.PRNGKey(0), (4000, 2, 2, 1))
    x0 = rollout.sample(lambda x, t: gaussian_velocity(m, s)(x, t), x_T, schedule.sigmas(200, 1.0))
    # Monte Carlo: 16,000 independent draws give standard errors s / sqrt(n) = 0.004 (mean) and s / sqrt(2n) = 0.0028 (std).
    # The velocity is affine, so 200 Euler steps map N(0, 1) exactly to N(0.8, 0.4963^2): bias 0 and -0.0037. 0.02 is
    # 5 SE on the mean and 0.0037 + 5.8 SE on the std (measured errors -9e-5 and -7e-4).
    assert abs(float(x0.mean()) - m) < 0.02 and abs(float(x0.std()) - s) < 0.02


def test_cfg_combines_conditional_and_unconditional():
    velocity = lambda x, t, c: x * c[:, None, None, None]  # noqa: E731 - v scales with the "condition"
    x, sigma = jnp.ones((3, 2, 2, 1)), jnp.full((3,), 0.5)
    v = rollout.guided(velocity, jnp.full((3,), 2.0), jnp.full((3,), 1.0), cfg=4.0)(x, sigma)
    np.testing.assert_allclose(v, 1.0 + 4.0 * (2.0 - 1.0))  # small integers, exact in float32 (default rtol 1e-7 ~ 1 eps)
    v1 = rollout.guided(velocity, jnp.full((3,), 2.0), None, cfg=1.0)(x, sigma)
    np.testing.assert_allclose(v1, 2.0)  # exact, as above
