"""Sigma schedule against SPEC.md's table, and the CFG ODE sampler against closed forms."""
import jax
import jax.numpy as jnp
import numpy as np

from flowrl_jax.sampling import ode, schedule


def test_schedule_matches_spec_table():
    # SPEC.md §0: T = 10, shift = 3 (diffusers' FlowMatchEulerDiscreteScheduler)
    expected = [1.0, .9601, .9133, .8577, .7904, .7073, .6022, .4649, .2780, .0089, 0.0]
    np.testing.assert_allclose(schedule.sigmas(10, 3.0), expected, atol=1e-4)
    np.testing.assert_allclose(schedule.sigmas(4, 1.0), [1.0, 2 / 3 + 1 / 3000, 1 / 3 + 2 / 3000, 0.001, 0.0], atol=1e-6)


def _gaussian_velocity(m, s):
    """Exact v(x, t) = E[eps - x0 | x_t = x] for x0 ~ N(m, s^2), eps ~ N(0, 1), x_t = (1 - t) x0 + t eps."""
    def v(x, t, cond):
        t = t[:, None, None, None]
        var = (1 - t) ** 2 * s**2 + t**2
        r = x - (1 - t) * m
        return t / var * r - (m + (1 - t) * s**2 / var * r)
    return v


def test_ode_transports_noise_to_the_gaussian_data_law():
    m, s = 0.8, 0.5
    x_T = jax.random.normal(jax.random.PRNGKey(0), (4000, 2, 2, 1))
    x0 = ode.sample_ode(_gaussian_velocity(m, s), x_T, schedule.sigmas(200, 1.0), None, None, cfg=1.0)
    assert abs(float(x0.mean()) - m) < 0.02 and abs(float(x0.std()) - s) < 0.02


def test_cfg_combines_conditional_and_unconditional():
    velocity = lambda x, t, c: x * c[:, None, None, None]  # noqa: E731 - v scales with the "condition"
    x = jnp.ones((3, 2, 2, 1))
    v = ode.guided_velocity(velocity, x, jnp.float32(0.5), jnp.full((3,), 2.0), jnp.full((3,), 1.0), cfg=4.0)
    np.testing.assert_allclose(v, 1.0 + 4.0 * (2.0 - 1.0))
    v1 = ode.guided_velocity(velocity, x, jnp.float32(0.5), jnp.full((3,), 2.0), None, cfg=1.0)
    np.testing.assert_allclose(v1, 2.0)
