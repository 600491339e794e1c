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
    levels = rollout.noise_levels(8, 0.7, (2, 3))
    ro = rollout.rollout(velocity, x_T, SIGMAS, levels, jax.random.PRNGKey(1), "sde", 2)
    np.testing.assert_array_equal(rollout.Schedule(SIGMAS, levels).trained, [False, False, True, True, True, False, False, False])
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


# ------------------------------------------------------------------ the tail after the window (MixGRPO's ODE sampler)
# The regridded sigmas against float64 hand values: float32 `schedule.sigmas` (linspace's `start + i step`, 2 roundings;
# shift 1 multiplies and divides by 1, exact) and `jnp.interp` (the position `e + k L / n`, its weight, and the blend
# `left + w (right - left)`: 4 roundings), each at most half an ulp of a value <= 1 (2^-24 = 6e-8): <= 6 x 6e-8 = 3.6e-7.
SIGMA_ATOL = 5e-7


def _mixgrpo_flash_grid(num_steps, last, ratio, shift):
    """A float64 transcription of MixGRPO-Flash's tail (`fastvideo/utils/sampling_utils.py` lines 33-51, commit e5cdd6a) on
    its own base grid `sd3_time_shift(shift, linspace(1, 0, N + 1))`: the schedule up to the window's last SDE step
    `last`, then `int(max((N - last) ratio, 1))` points evenly spaced in unshifted time from `linspace(1, 0, N + 1)[last + 1]`
    to 0, shifted."""
    sh = lambda t: shift * t / (1 + (shift - 1) * t)  # noqa: E731 (sd3_time_shift)
    base = sh(np.linspace(1, 0, num_steps + 1))
    points = int(max((num_steps - last) * ratio, 1))
    post = sh(np.linspace(np.linspace(1, 0, num_steps + 1)[last + 1], 0, points))
    return base, np.concatenate([base[: last + 1], post]), points


@pytest.mark.parametrize("shift", [1.0, 3.0])
@pytest.mark.parametrize("window,ratio", [((0, 4), 0.4), ((2, 2), 0.8), ((0, 2), 0.4), ((5, 3), 0.2), ((0, 4), 0.55)])
def test_tail_schedule_is_mixgrpo_flashs_grid(shift, window, ratio):
    """On MixGRPO's base grid (N = 25 as its scripts, or 10), the tail steps go between upstream's points; where upstream keeps
    a single point (never reaching 0: `int(max(., 1)) = 1`), ours takes one step from sigma_e to 0."""
    for num_steps in (10, 25):
        start, size = window
        last = start + size - 1
        base, reference, points = _mixgrpo_flash_grid(num_steps, last, ratio, shift)
        levels = rollout.noise_levels(num_steps, 0.7, window)
        frm, to, active, tail = (np.asarray(u) for u in rollout.tail_schedule(jnp.asarray(base, jnp.float32), levels, ratio, shift))
        e = last + 1
        np.testing.assert_array_equal(tail, np.arange(num_steps) >= e)
        # float32: sigma_e read from the base grid (1 rounding), unshifted and t scaled (4), shifted back (4): 9 roundings of
        # values <= 1 relative to their size, so <= 9 x 6e-8 = 5.4e-7 absolute; a grid spaced otherwise is off by >= 1e-2
        np.testing.assert_allclose(frm[:e], base[:e], atol=SIGMA_ATOL)  # the window and before: the base grid, 2 roundings
        if points >= 2:
            n = points - 1
            np.testing.assert_array_equal(active, np.arange(num_steps) < e + n)
            np.testing.assert_allclose(frm[e : e + n], reference[e : e + n], atol=1e-6)  # 9 roundings <= 5.4e-7 (above)
            np.testing.assert_allclose(to[e : e + n], reference[e + 1 : e + n + 1], atol=1e-6)  # 9 roundings <= 5.4e-7
        else:  # upstream's edge: one point, sigma_e, and no step to 0; ours: one step sigma_e -> 0
            np.testing.assert_allclose([frm[e], to[e]], [reference[e], 0.0], atol=1e-6)  # 9 roundings <= 5.4e-7
            np.testing.assert_array_equal(active, np.arange(num_steps) < e + 1)


def test_tail_schedule_at_ratio_1_keeps_the_base_grid():
    sigmas = schedule.sigmas(10, 3.0)
    frm, to, active, tail = rollout.tail_schedule(sigmas, rollout.noise_levels(10, 0.7, (2, 2)), 1.0, 3.0)
    np.testing.assert_array_equal(frm, sigmas[:-1])
    np.testing.assert_array_equal(to, sigmas[1:])
    assert bool(np.all(active)) and list(np.asarray(tail)) == [False] * 4 + [True] * 6


def test_dpm_solver_2m_converges_at_second_order_to_the_gaussian_closed_form():
    """For x0 ~ N(m, s^2) the probability-flow ODE keeps `z = (x - (1 - sigma) m) / std_sigma` fixed, so x at the end
    is known in closed form. On a grid uniform in lambda from sigma 0.9 to 0.1, DPM-Solver++(2M)'s error falls ~4x per
    halving of the step (Euler's ~2x). Float64, so the rounding (~1e-16 x 128 steps) is far below the errors (>= 4e-5).
    Bounds: the next term of the error expansion moves the observed order by O(1/T) (measured 1.87 at 32 -> 64 and 1.95
    at 64 -> 128 for DPM, 0.99 for Euler), so [1.8, 2.2] and [0.9, 1.1] at 64 -> 128 hold with margin."""
    m, s = 0.5, 0.4
    with jax.enable_x64(True):
        velocity = gaussian_velocity(m, s)
        z = jax.random.normal(jax.random.PRNGKey(0), (2, 4, 4, 1), jnp.float64)
        at = lambda sigma: (1 - sigma) * m + ((1 - sigma) ** 2 * s**2 + sigma**2) ** 0.5 * z  # noqa: E731
        errors = {}
        for solver in ("euler", "dpm2m"):
            for steps in (64, 128):
                sigmas = 1 / (1 + jnp.exp(jnp.linspace(np.log(0.1 / 0.9), np.log(0.9 / 0.1), steps + 1)))
                ro = rollout.rollout(velocity, at(sigmas[0]), sigmas, jnp.zeros(steps), jax.random.PRNGKey(1), "ode", 2,
                                     tail_solver=solver)
                errors[solver, steps] = float(jnp.max(jnp.abs(ro.final - at(sigmas[-1]))))
    assert 1.8 <= np.log2(errors["dpm2m", 64] / errors["dpm2m", 128]) <= 2.2, errors
    assert 0.9 <= np.log2(errors["euler", 64] / errors["euler", 128]) <= 1.1, errors
    assert errors["dpm2m", 64] < errors["euler", 64] / 50, errors  # measured 1.5e-4 against 1.5e-2


def test_a_coarser_tail_keeps_the_window_and_skipped_steps_leave_the_state():
    velocity = gaussian_velocity(0.5, 0.4)
    x_T = jax.random.normal(jax.random.PRNGKey(0), (3, 4, 4, 1))
    sigmas = schedule.sigmas(10, 1.0)
    levels = rollout.noise_levels(10, 0.7, (2, 2))
    plain = rollout.rollout(velocity, x_T, sigmas, levels, jax.random.PRNGKey(1), "sde", 2)
    # ratio 0.6: int(4.2) = 4 points evenly spaced from sigma_4 to 0 (shift 1: unshifted time is sigma), 3 steps:
    # sigma_4 -> 2 sigma_4 / 3 -> sigma_4 / 3 -> 0, steps 7-9 skipped
    flash = rollout.rollout(velocity, x_T, sigmas, levels, jax.random.PRNGKey(1), "sde", 2, tail_solver="dpm2m", tail_ratio=0.6)
    # Steps 0..3 (the prefix and the window) are the same draws by the same kernel; the cond around them may fuse
    # differently: a few FMA roundings per step on |x| <= 3, as in the first test (1e-6).
    np.testing.assert_allclose(flash.next_states[:, :4], plain.next_states[:, :4], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(flash.logp[:, 4:], 0.0)
    for t in range(7, 10):  # skipped: the state stays
        np.testing.assert_array_equal(flash.next_states[:, t], flash.states[:, t])
    np.testing.assert_array_equal(flash.final, flash.next_states[:, 6])
    # step 4: sigma_4 -> 2 sigma_4 / 3 by DPM-Solver++(2M) from the window's last x0, in float64 by hand from the recorded states
    s4, s3 = (float(sigmas[i]) for i in (4, 3))
    s6 = 2 * s4 / 3
    lam = lambda s: np.log((1 - s) / s)  # noqa: E731
    h, h_prev = lam(s6) - lam(s4), lam(s4) - lam(s3)
    x, x0, x0_prev = (np.asarray(a, np.float64) for a in (flash.states[:, 4], flash.x0_hat[:, 4], flash.x0_hat[:, 3]))
    d = (1 + h / (2 * h_prev)) * x0 - h / (2 * h_prev) * x0_prev
    # ~10 float32 roundings of terms <= ~3 (6e-8 x 3 each) and h's logs: 1e-5
    np.testing.assert_allclose(flash.next_states[:, 4], s6 / s4 * x + (1 - s6 - (1 - s4) * s6 / s4) * d, atol=1e-5)
    # The last step, to sigma = 0, is x0 (first order): coefficients 0 and 1, exact in exact arithmetic; 1e-6 leaves room for
    # XLA reassociating the zero terms (a few half-ulps of |x0| <= 3: <= 4 x 1.8e-7 = 7e-7).
    np.testing.assert_allclose(flash.final, flash.x0_hat[:, 6], atol=1e-6)
    with pytest.raises(ValueError, match="tail_solver"):
        rollout.rollout(velocity, x_T, sigmas, levels, jax.random.PRNGKey(1), tail_solver="heun")
