"""The scanned rollout: SDE windows, shared group noise, Tweedie estimates, and 8-device sharding."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from flowrl_jax import parallel
from flowrl_jax.sampling import rollout, schedule
from tests.conftest import gaussian_velocity, random_inputs

SIGMAS = schedule.sigmas(8, 3.0)
EPS = float(np.finfo(np.float32).eps)  # 1.19e-7


def test_window_steps_are_sde_and_the_rest_ode():
    velocity = gaussian_velocity(0.5, 0.4)
    x_T = jax.random.normal(jax.random.PRNGKey(0), (3, 4, 4, 1))
    ro = rollout.rollout(velocity, x_T, SIGMAS, rollout.noise_levels(8, 0.7, (2, 3)), jax.random.PRNGKey(1), "sde", 2)
    np.testing.assert_array_equal(ro.trained, [False, False, True, True, True, False, False, False])
    assert np.all(ro.stds[:, 2:5] > 0) and np.all(ro.stds[:, [0, 1, 5, 6, 7]] == 0)
    assert np.all(ro.logp[:, [0, 1, 5, 6, 7]] == 0) and np.all(ro.logp[:, 2:5] != 0)
    for t in (0, 6):  # outside the window: Euler, exactly
        v = velocity(ro.states[:, t], jnp.full((3,), SIGMAS[t]))
        # 1e-6 = 8 eps: the scan and this eager recomputation run the same float32 ops and differ only where XLA fuses a
        # multiply-add into one FMA (one rounding fewer, <= eps/2 of the product): 4 such in v and in the step, products
        # <= 3 here (|x|, |v| <= 2.5) -> <= 4 x 3 eps/2 = 6 eps = 7e-7. Measured 1.2e-7.
        np.testing.assert_allclose(ro.next_states[:, t], ro.states[:, t] + v * (SIGMAS[t + 1] - SIGMAS[t]), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(ro.x0_hat[:, t], ro.states[:, t] - SIGMAS[t] * v, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(ro.states[:, 1:], ro.next_states[:, :-1])
    np.testing.assert_array_equal(ro.states[:, 0], x_T)
    with pytest.raises(ValueError, match="does not fit"):
        rollout.noise_levels(8, 0.7, (6, 3))


def test_same_noise_per_group():
    x = rollout.initial_noise(jax.random.PRNGKey(0), (6, 2, 2, 1), group_size=3, same_per_group=True)
    np.testing.assert_array_equal(x[0], x[2])
    assert not np.allclose(x[0], x[3])  # independent N(0, 1) draws differ by O(1); allclose's defaults only rule out equality
    y = rollout.initial_noise(jax.random.PRNGKey(0), (6, 2, 2, 1), group_size=3)
    assert not np.allclose(y[0], y[1])  # as above


# Sharded and one-device rollouts compute the same float32 math and differ only in summation order (a batch of 1 vs 8
# per device, FSDP partial sums added across devices, XLA:CPU's per-shape blocking, which differs between CPUs). The
# worst-case reordering error of a K-term reduction is K eps sum|terms|; one tiny-DiT call has 2,512 reduced terms (43
# matmuls with sum K = 1,782 and 29 sums with 730, counted from its jaxpr) plus 261 elementwise ops (one rounding each
# where fusion differs): <= 2,800 eps of the output's scale. CFG's v_u + cfg (v_c - v_u) amplifies that by 1 + 2 cfg = 5,
# and T = 8 steps accumulate it linearly (lc's second call enters with weight a^2 sigma' (1 - sigma') / 2 <= 0.06).
CFG = 2.0
SHARDED_RTOL = 8 * (1 + 2 * CFG) * 2800 * EPS  # 1.3e-2 of each leaf's max|.|. Measured <= 1.6e-6 (x0_hat, AMD EPYC, also
# with XLA limited to SSE4.2 or AVX). A sharding bug moves what it touches by >= 0.3 of max|.| (measured: noise drawn with
# another key 0.31-0.53, prompts shifted by one row 0.98-1.1, half of each fc1 kernel lost 0.36-0.54): >= 24x the bound.


@pytest.mark.parametrize("kind", ["sde", "lc"])
def test_sharded_rollout_on_eight_devices_equals_one_device(tiny_model, tiny_params, kind):
    _, _, txt, pooled = random_inputs(tiny_model, batch=8, text_len=5)
    x_T = jax.random.normal(jax.random.PRNGKey(2), (8, 8, 8, tiny_model.in_channels))

    def run(params, txt, pooled, x_T, rng):
        v = lambda x, s, c: tiny_model.apply({"params": params}, x, s, *c)  # noqa: E731
        velocity = rollout.guided(v, (txt, pooled), (jnp.zeros_like(txt), jnp.zeros_like(pooled)), CFG)
        return rollout.rollout(velocity, x_T, SIGMAS, rollout.noise_levels(8, 0.7, (1, 4)), rng, kind, tiny_model.patch_size)

    mesh8 = parallel.make_mesh((("data", 4), ("fsdp", 2)))
    mesh1 = parallel.make_mesh((("data", 1), ("fsdp", 1)), devices=jax.devices()[:1])
    outs = []
    for mesh in (mesh8, mesh1):
        data, rep = parallel.batch_sharding(mesh), NamedSharding(mesh, P())
        params = jax.device_put(tiny_params, parallel.tree_shardings(tiny_params, mesh, min_fsdp_size=1))
        fn = jax.jit(run, in_shardings=(parallel.tree_shardings(tiny_params, mesh, min_fsdp_size=1), data, data, data, rep),
                     )
        outs.append(fn(params, txt, pooled, x_T, jax.random.PRNGKey(3)))
    assert len(outs[0].final.sharding.device_set) == 8
    for a, b in zip(jax.tree_util.tree_leaves(outs[0]), jax.tree_util.tree_leaves(outs[1])):
        np.testing.assert_allclose(a, b, rtol=0, atol=SHARDED_RTOL * np.abs(b).max())  # derived above the test
    assert np.all(np.isfinite(outs[0].logp))
