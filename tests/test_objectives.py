"""AdvantageFlow, DiffusionNFT and LeapAlign (docs/math.md §6) against closed forms, finite differences and
compiled memory sizes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flowrl_jax.objectives import advantage_flow, leap, nft
from flowrl_jax.objectives.batch import ParamTrees
from flowrl_jax.rl.policy import PolicyFns
from flowrl_jax.sampling import schedule
from tests.conftest import gaussian_velocity


# ------------------------------------------------------------------------------------------ AdvantageFlow
def test_advantage_flow_weights_are_nonnegative_and_zero_advantage_is_plain_flow_matching():
    rng = np.random.default_rng(0)
    adv = jnp.asarray(rng.normal(size=64) * 3, jnp.float32)
    w = advantage_flow.pair_weights(adv, jnp.max(-adv), 0.5)
    assert float(w.min()) >= 0.5 - 1e-6 and abs(float(w.min()) - 0.5) < 1e-6  # the worst sample sits at beta0
    v, target = (rng.normal(size=(5, 4, 4, 3)).astype(np.float32) for _ in range(2))
    weight = np.array([1, 1, 1, 1, 0], np.float32)  # the last pair is padding
    zero = jnp.zeros(5)
    got = advantage_flow.weighted_flow_matching(jnp.asarray(v), jnp.asarray(target), zero, jnp.max(-zero), jnp.asarray(weight), 2.0)
    expected = 2.0 * np.mean(((v - target) ** 2)[:4])
    np.testing.assert_allclose(float(got), expected, rtol=1e-5)


def test_advantage_flow_is_convex_in_the_velocity():
    rng = np.random.default_rng(1)
    adv = jnp.asarray(rng.normal(size=3) * 2, jnp.float32)
    target = jnp.asarray(rng.normal(size=(3, 2, 2, 1)), jnp.float32)
    f = lambda flat: advantage_flow.weighted_flow_matching(flat.reshape(target.shape), target, adv, jnp.max(-adv),  # noqa: E731
                                                            jnp.ones(3), 1.0)
    hessian = jax.hessian(f)(jnp.asarray(rng.normal(size=target.size), jnp.float32))
    eig = np.linalg.eigvalsh(np.asarray(hessian, np.float64))
    # diag(2 (beta + A_i) / (M D)) with every beta + A_i >= beta0 = 1: positive definite
    assert eig.min() > 0
    np.testing.assert_allclose(np.sort(eig), np.sort(np.repeat(2 * (np.asarray(adv) + float(jnp.max(-adv)) + 1.0) / 12, 4)),
                               rtol=1e-5)


def test_advantage_flow_anchored_form_is_convex_and_zero_advantage_at_the_rollout_policy_has_no_gradient():
    rng = np.random.default_rng(3)
    adv = jnp.asarray(rng.normal(size=3) * 2, jnp.float32)
    target, v_old = (jnp.asarray(rng.normal(size=(3, 2, 2, 1)), jnp.float32) for _ in range(2))
    f = lambda flat: advantage_flow.weighted_flow_matching(flat.reshape(target.shape), target, adv, jnp.max(-adv),  # noqa: E731
                                                            jnp.ones(3), 1.0, v_old)
    eig = np.linalg.eigvalsh(np.asarray(jax.hessian(f)(jnp.asarray(rng.normal(size=target.size), jnp.float32)), np.float64))
    np.testing.assert_allclose(np.sort(eig), np.sort(np.repeat(2 * (np.asarray(adv) + float(jnp.max(-adv)) + 1.0) / 12, 4)),
                               rtol=1e-5)  # the same Hessian as docs/math.md's form
    zero = jnp.zeros(3)
    g = jax.grad(lambda v: advantage_flow.weighted_flow_matching(v, target, zero, zero.max(), jnp.ones(3), 1.0, v_old))(v_old)
    assert float(jnp.abs(g).max()) == 0.0


def test_advantage_flow_anchored_form_has_spec_s_expected_gradient_with_less_noise():
    """1-D toy: samples x0 ~ N(m_old, s^2), whose exact flow is `v_old`; the policy is the Gaussian velocity
    of mean m. Where `v_old = E[eps - x0 | x_t]`, replacing the beta part's target by `v_old` keeps the
    expected gradient in m (Monte Carlo, 200k pairs) and removes the target's sampling noise."""
    s, m_old, m, n = 0.5, 0.2, 0.5, 200_000
    rng = np.random.default_rng(4)
    x0 = (m_old + s * rng.normal(size=(n, 1))).astype(np.float32)
    t = rng.uniform(0.05, 0.95, size=n).astype(np.float32)
    eps = rng.normal(size=(n, 1)).astype(np.float32)
    x_t = jnp.asarray((1 - t[:, None]) * x0 + t[:, None] * eps)
    adv = jnp.asarray(np.where(x0[:, 0] > m_old, 1.0, -1.0), jnp.float32)
    target, v_old = jnp.asarray(eps - x0), gaussian_velocity(m_old, s)(x_t, jnp.asarray(t))

    def per_pair_grads(anchor):
        def loss(m, x, t_, u, a, vo):  # one pair's loss, so the per-pair gradients give the Monte Carlo error
            v = gaussian_velocity(m, s)(x[None], t_[None])
            return advantage_flow.weighted_flow_matching(v, u[None], a[None], jnp.float32(1.0), jnp.ones(1), 0.5,
                                                         vo[None] if anchor else None)
        grads = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0, 0, 0, 0))(jnp.float32(m), x_t, jnp.asarray(t), target, adv, v_old)
        return np.asarray(grads, np.float64)

    spec, anchored = per_pair_grads(False), per_pair_grads(True)
    stderr = np.sqrt(np.var(spec - anchored) / n)
    assert abs(spec.mean() - anchored.mean()) < 4 * stderr
    assert abs(anchored.mean()) > 20 * stderr  # the gradient itself is far from zero at m != m_old
    assert anchored.std() < 0.7 * spec.std()  # measured 0.62 (the A part keeps its sampling noise)


# -------------------------------------------------------------------------------------------- DiffusionNFT
def test_nft_gradient_at_the_old_policy_points_toward_positives_and_matches_the_closed_form():
    """1-D toy: x0 ~ N(m, s^2) with its analytic velocity, the parameter is m. Samples above the old
    mean are positives (A = +5, r = 1), below are negatives (r = 0); descent must raise m."""
    s, m_old, b = 0.5, 0.2, 1.0
    rng = np.random.default_rng(2)
    x0 = (m_old + s * rng.normal(size=(256, 1))).astype(np.float32)
    t = rng.uniform(0.1, 0.9, size=256).astype(np.float32)
    eps = rng.normal(size=(256, 1)).astype(np.float32)
    x_t = (1 - t[:, None]) * x0 + t[:, None] * eps
    adv = np.where(x0[:, 0] > m_old, 5.0, -5.0).astype(np.float32)
    r = nft.optimality(jnp.asarray(adv))
    np.testing.assert_array_equal(r, (adv > 0).astype(np.float32))

    def loss(m):
        v = gaussian_velocity(m, s)(jnp.asarray(x_t), jnp.asarray(t))
        v_old = gaussian_velocity(m_old, s)(jnp.asarray(x_t), jnp.asarray(t))
        return nft.nft_terms(v, v_old, jnp.asarray(x_t), jnp.asarray(x0), jnp.asarray(t), r, b).mean()

    grad = float(jax.grad(loss)(jnp.float32(m_old)))
    assert grad < 0  # gradient descent moves the mean toward the positive samples
    # closed form at theta = theta_old: dL/dm = mean 2 t v_m (x0_hat - x0) (1 - 2 r) / |x0_hat - x0|
    var = (1 - t) ** 2 * s**2 + t**2
    v_m = -(1 - t) * t / var - 1 + (1 - t) ** 2 * s**2 / var  # d v / d m of the Gaussian velocity, by hand
    v_old = np.asarray(gaussian_velocity(m_old, s)(jnp.asarray(x_t), jnp.asarray(t)))[:, 0]
    err = x_t[:, 0] - t * v_old - x0[:, 0]
    expected = np.mean(2 * t * v_m * err * (1 - 2 * np.asarray(r)) / np.maximum(np.abs(err), 1e-5))
    np.testing.assert_allclose(grad, expected, rtol=2e-4)


def test_nft_loss_scale_and_kl_term_equal_nvlabs_formula_in_float64():
    """`L = adv_clip_max * mean_w[(r ||x0+ - x0||^2 / w+ + (1 - r) ||x0- - x0||^2 / w-) / b] + beta_kl mean_w ||v - v_ref||^2`
    (NVlabs `train_nft_sd3.py`), written out in NumPy float64 on an affine velocity `v = a x + c`, with advantages past
    the clip, a padding pair (weight 0) and non-default beta, beta_kl, adv_clip_max: pins the x adv_clip_max factor and
    the beta_kl term."""
    class Fns:
        @staticmethod
        def velocity(p, x, t, mb):
            return p["a"] * x + p["c"]

    rng = np.random.default_rng(5)
    x_t, x0 = (rng.normal(size=(5, 2, 2, 1)) for _ in range(2))
    t = rng.uniform(0.1, 0.9, size=5)
    adv, weight = np.array([7.0, -2.0, 0.0, 12.0, -8.0]), np.array([1.0, 1.0, 1.0, 1.0, 0.0])
    policy, old, ref = {"a": 0.7, "c": 0.1}, {"a": 0.5, "c": 0.0}, {"a": 0.3, "c": -0.2}
    options = {**nft.DEFAULTS, "beta": 0.8, "beta_kl": 0.05, "adv_clip_max": 4.0}
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    mb = {"x_t": f32(x_t), "x0": f32(x0), "t": f32(t), "adv": f32(adv), "weight": f32(weight)}
    trees = ParamTrees(*({k: f32(v) for k, v in p.items()} for p in (policy, ref, old)))
    got, aux = nft.loss(trees, mb, Fns, options)

    v, v_old, v_ref = (p["a"] * x_t + p["c"] for p in (policy, old, ref))
    b, tt = 0.8, t[:, None, None, None]
    r = np.clip(adv / 4.0 / 2 + 0.5, 0, 1)  # [1, 0.25, 0.5, 1, 0]
    x0_pos, x0_neg = x_t - tt * (b * v + (1 - b) * v_old), x_t - tt * ((1 + b) * v_old - b * v)
    w_pos, w_neg = (np.maximum(np.abs(e - x0).mean((1, 2, 3)), 1e-5) for e in (x0_pos, x0_neg))
    terms = (r * ((x0_pos - x0) ** 2).mean((1, 2, 3)) / w_pos + (1 - r) * ((x0_neg - x0) ** 2).mean((1, 2, 3)) / w_neg) / b
    policy_loss = 4.0 * (weight * terms).sum() / weight.sum()
    kl = (weight * ((v - v_ref) ** 2).mean((1, 2, 3))).sum() / weight.sum()
    # rtol 1e-5, for each of the three: float32 against float64. The longest path (input rounding, v, x0+-, the difference
    # to x0, its square, the 4-element mean, / w, x r, the 5-pair weighted mean, x adv_clip_max) has ~20 roundings of
    # 2^-24 = 6e-8, on operands at most ~3 (|x_t| + |t v|) against results at least ~0.6 (w+-, the terms, kl here), so
    # at most 20 x 6e-8 x 3 / 0.6 = 6e-6 relative in the worst alignment. Measured: 5e-8.
    np.testing.assert_allclose(aux["policy_loss"], policy_loss, rtol=1e-5)
    np.testing.assert_allclose(aux["kl"], kl, rtol=1e-5)
    np.testing.assert_allclose(got, policy_loss + 0.05 * kl, rtol=1e-5)


def test_nft_old_policy_decay_schedules_at_hand_computed_steps():
    """NVlabs' decay_type 1 (flat 0, rate 0.001, cap 0.5) and 2 (flat 75, rate 0.0075, cap 0.999), by hand."""
    steps = jnp.array([0.0, 74.0, 75.0, 100.0, 208.0, 300.0, 5000.0])
    # float32: (step - flat) x rate and the min with the cap, <= 3 roundings of 2^-24 = 1.8e-7 relative < 1e-6
    np.testing.assert_allclose(nft.old_policy_decay(steps, {"decay": "linear"}), [0.0, 0.074, 0.075, 0.1, 0.208, 0.3, 0.5], rtol=1e-6)
    np.testing.assert_allclose(nft.old_policy_decay(steps, {"decay": "flat_then_rise"}),  # <= 3 roundings, as above
                               [0.0, 0.0, 0.0, 25 * 0.0075, 133 * 0.0075, 0.999, 0.999], rtol=1e-6)


def test_old_policy_follows_by_the_decay_at_the_optimizer_steps_done_not_the_iterations():
    """NVlabs' `return_decay(global_step)` counts gradient steps: after 3 iterations of 7 optimizer steps in all,
    "linear" gives d = 0.007, so `old <- 0.007 old + 0.993 params` (by hand; 3 iterations would give 0.003)."""
    from flowrl_jax.rl.state import TrainState, update_old_policy
    state = TrainState(step=jnp.array(3), updates=jnp.array(7), params={"w": jnp.full((2,), 2.0)}, ema=None, opt_state=None,
                       credit={}, old={"w": jnp.zeros((2,))})
    new = update_old_policy(state, lambda n: nft.old_policy_decay(n, {"decay": "linear"}))
    # float32: d = 7 x 0.001 (2 roundings), 1 - d, the two products and their sum (4 more), each <= 2^-24 = 6e-8 relative:
    # <= 6 x 6e-8 = 3.6e-7 < 1e-6
    np.testing.assert_allclose(new.old["w"], 0.993 * 2.0, rtol=1e-6)  # 6 float32 roundings: <= 3.6e-7 relative


def test_nft_sampler_times_give_each_sample_distinct_sampler_timesteps():
    """`times="sampler"`: per sample, its slots are distinct values of the sampler's sigma_0..sigma_{T-1}, the same
    whichever minibatch a pair lands in (drawn from the iteration's key), and the order differs across samples."""
    from flowrl_jax.objectives import forward
    options = {"times": "sampler", "timesteps": 9, "num_steps": 10, "shift": 1.0}
    sigmas = np.asarray(schedule.sigmas(10, 1.0))[:-1]
    rows, slots = (a.ravel() for a in np.meshgrid(np.arange(6), np.arange(9), indexing="ij"))
    t = np.asarray(forward.pair_times(jax.random.PRNGKey(0), jnp.asarray(rows), jnp.asarray(slots), options)).reshape(6, 9)
    for row in t:
        assert len(set(row.tolist())) == 9 and set(row.tolist()) <= set(sigmas.tolist())  # 9 distinct sampler times
    assert len({tuple(row) for row in t}) > 1
    again = forward.pair_times(jax.random.PRNGKey(0), jnp.asarray(rows[::-1].copy()), jnp.asarray(slots[::-1].copy()), options)
    np.testing.assert_array_equal(np.asarray(again)[::-1].reshape(6, 9), t)  # a pair's time does not depend on its minibatch


# ----------------------------------------------------------------------------------------------- LeapAlign
def _mlp(params, x, sigma):
    flat = x.reshape(x.shape[0], -1)
    h = jnp.tanh(jnp.concatenate([flat, sigma[:, None]], axis=1) @ params["w1"])
    return (h @ params["w2"]).reshape(x.shape)


def _mlp_params(key, dim, hidden=16, dtype=jnp.float32):
    k1, k2 = jax.random.split(key)
    return {"w1": 0.3 * jax.random.normal(k1, (dim + 1, hidden), dtype), "w2": 0.3 * jax.random.normal(k2, (hidden, dim), dtype)}


def _ode_trajectory(params, x_T, sigmas):
    """States before each step [B, T, ...] and the final sample, by plain Euler (a loop, independently of rollout.py)."""
    states, x = [], x_T
    for i in range(len(sigmas) - 1):
        states.append(x)
        x = x + (sigmas[i + 1] - sigmas[i]) * _mlp(params, x, jnp.full((x.shape[0],), sigmas[i]))
    return jnp.stack(states, 1), x


def _reward(x):
    return -jnp.mean(jnp.square(x - 0.3), axis=(1, 2, 3))


def _leap_batch(params, weight):
    """Four pairs (k < j) of one 6-step Euler trajectory of `_mlp(params)`, with their weights [4]."""
    sigmas = schedule.sigmas(6, 3.0)
    states, x0 = _ode_trajectory(params, jax.random.normal(jax.random.PRNGKey(1), (4, 2, 2, 3)), sigmas)
    i_k, i_j, rows = jnp.array([0, 1, 2, 0]), jnp.array([3, 2, 5, 1]), jnp.arange(4)
    return {"x_k": states[rows, i_k], "x_j": states[rows, i_j], "x0": x0, "sigma_k": sigmas[i_k], "sigma_j": sigmas[i_j],
            "weight": weight}


def test_leap_connectors_give_the_real_trajectory_and_the_loss_value_is_the_real_reward():
    params = _mlp_params(jax.random.PRNGKey(0), 2 * 2 * 3)
    mb = _leap_batch(params, jnp.ones(4))
    x0 = mb["x0"]
    velocity = lambda x, s: _mlp(params, x, s)  # noqa: E731
    x0_tilde, x_j_hat, _ = leap.two_leaps(velocity, mb["x_k"], mb["x_j"], x0, mb["sigma_k"], mb["sigma_j"], 0.5)
    np.testing.assert_allclose(x0_tilde, x0, rtol=0, atol=1e-6)
    assert float(jnp.abs(x_j_hat - mb["x_j"]).max()) > 1e-3  # the leap itself is off the path; the connector fixes it
    fns = PolicyFns(None, lambda p, x, s, mb: _mlp(p, x, s), lambda _, x, mb: _reward(x))
    value, aux = leap.loss(ParamTrees(params, None), mb, fns, {**leap.DEFAULTS, "gamma": 0.5, "tau": 0.01})
    e = np.mean((np.asarray(x_j_hat, np.float64) - np.asarray(mb["x_j"], np.float64)) ** 2, axis=(1, 2, 3))
    w = np.exp(-(e - e.min()) / 0.01) / np.exp(-(e - e.min()) / 0.01).sum()  # softmax by hand, float64
    np.testing.assert_allclose(float(value), float(-np.sum(w * np.asarray(_reward(x0), np.float64))), rtol=1e-5)


def test_leap_anchor_adds_beta_times_the_velocity_gap_to_the_reference_at_x_k():
    """`beta_kl` adds `beta * mean_b mean_e (v_theta(x_k) - v_ref(x_k))^2`, checked in float64 by hand."""
    params, ref = (_mlp_params(jax.random.PRNGKey(i), 2 * 2 * 3) for i in (0, 7))
    mb = _leap_batch(params, jnp.array([1.0, 1.0, 1.0, 0.0]))
    fns = PolicyFns(None, lambda p, x, s, mb: _mlp(p, x, s), lambda _, x, mb: _reward(x))
    plain, _ = leap.loss(ParamTrees(params, ref), mb, fns, dict(leap.DEFAULTS))
    anchored, aux = leap.loss(ParamTrees(params, ref), mb, fns, {**leap.DEFAULTS, "beta_kl": 0.7})
    gap = np.asarray(_mlp(params, mb["x_k"], mb["sigma_k"]), np.float64) - np.asarray(_mlp(ref, mb["x_k"], mb["sigma_k"]), np.float64)
    kl = np.mean(np.mean(gap ** 2, axis=(1, 2, 3))[:3])  # the padding row (weight 0) is left out
    assert kl > 1e-3  # the two networks differ, so the check has something to see
    np.testing.assert_allclose(float(aux["kl"]), kl, rtol=1e-5)  # float32 sums of 12 elements x 3 rows: ~1e-6 relative
    np.testing.assert_allclose(float(anchored) - float(plain), 0.7 * kl, rtol=1e-4)  # a difference of two float32 losses


def test_leap_negative_anchor_is_named():
    sampler = type("Sampler", (), {"kind": "ode"})()
    with pytest.raises(ValueError, match=r"objective.leapalign.beta_kl=-1.0: the anchor's weight must be >= 0"):
        leap.check({**leap.DEFAULTS, "beta_kl": -1.0}, sampler)
    leap.check(dict(leap.DEFAULTS), sampler)  # the defaults pass


def test_leap_gradient_equals_a_finite_difference_of_the_surrogate():
    """docs/math.md §6 testing note: d L / d theta = -d S / d theta at theta_0, with
    S(theta) = sg(grad R(x_0)) . [x~(theta) - sigma_j v_theta(u(theta))], x~(theta) = x_j + (x^_j(theta) - x^_j(theta_0)),
    u(theta) = x_j + gamma (x^_j(theta) - x^_j(theta_0)): the identity path at full weight, gamma on the velocity's input."""
    with jax.enable_x64(True):
        params = _mlp_params(jax.random.PRNGKey(3), 2 * 2 * 3, dtype=jnp.float64)
        sigmas = schedule.sigmas(8, 3.0).astype(jnp.float64)
        states, x0 = _ode_trajectory(params, jax.random.normal(jax.random.PRNGKey(4), (1, 2, 2, 3), jnp.float64), sigmas)
        gamma, ik, ij = 0.3, 1, 5
        x_k, x_j, s_k, s_j = states[:, ik], states[:, ij], sigmas[ik:ik + 1], sigmas[ij:ij + 1]
        mb = {"x_k": x_k, "x_j": x_j, "x0": x0, "sigma_k": s_k, "sigma_j": s_j, "weight": jnp.ones(1)}
        fns = PolicyFns(None, lambda p, x, s, mb: _mlp(p, x, s), lambda _, x, mb: _reward(x))
        grad = jax.grad(lambda p: leap.loss(ParamTrees(p, None), mb, fns, {**leap.DEFAULTS, "gamma": gamma, "tau": 0.01})[0])(params)

        g_r = jax.grad(lambda x: _reward(x).sum())(x0)
        x_j_hat = lambda p: x_k - (s_k - s_j)[:, None, None, None] * _mlp(p, x_k, s_k)  # noqa: E731

        def surrogate(p):
            x_tilde = x_j + (x_j_hat(p) - x_j_hat(params))
            u = x_j + gamma * (x_j_hat(p) - x_j_hat(params))
            return jnp.sum(g_r * (x_tilde - s_j[:, None, None, None] * _mlp(p, u, s_j)))

        direction = jax.tree_util.tree_map(lambda a: jax.random.normal(jax.random.PRNGKey(5), a.shape, a.dtype), params)
        h = 1e-5
        shifted = lambda c: jax.tree_util.tree_map(lambda a, d: a + c * h * d, params, direction)  # noqa: E731
        fd = (surrogate(shifted(1.0)) - surrogate(shifted(-1.0))) / (2 * h)
        analytic = sum(jnp.sum(g * d) for g, d in zip(jax.tree_util.tree_leaves(grad), jax.tree_util.tree_leaves(direction)))
        assert abs(float(fd)) > 1e-4
        np.testing.assert_allclose(float(analytic), -float(fd), rtol=1e-6)


@pytest.mark.parametrize("gamma", [0.0, 0.5, 1.0])
def test_leap_placement_keeps_the_identity_path_whatever_gamma(gamma):
    """docs/math.md §6 placement check: with a velocity that does not depend on x, x^_0 = x~_j - sigma_j c, so
    d x~_0 / d x_k = I (through x^_j = x_k - (sigma_k - sigma_j) c) whatever gamma is; placing gamma on the
    identity path too (the old code) gives gamma I."""
    c = jax.random.normal(jax.random.PRNGKey(0), (2, 2, 2, 3))
    velocity = lambda x, sigma: c  # noqa: E731
    x_k, x_j, x0 = (jax.random.normal(jax.random.PRNGKey(i), (2, 2, 2, 3)) for i in (1, 2, 3))
    sigma_k, sigma_j = jnp.array([0.9, 0.8]), jnp.array([0.4, 0.3])
    probe = jax.random.normal(jax.random.PRNGKey(4), x0.shape)
    grad = jax.grad(lambda xk: jnp.sum(probe * leap.two_leaps(velocity, xk, x_j, x0, sigma_k, sigma_j, gamma)[0]))(x_k)
    np.testing.assert_allclose(grad, probe, rtol=1e-6)  # the identity Jacobian, exactly (no float op touches it)


def test_leap_weights_are_the_softmax_of_the_leap_errors_over_real_pairs():
    rng = np.random.default_rng(5)
    x_j_hat, x_j = (rng.normal(size=(4, 2, 2, 3)).astype(np.float32) for _ in range(2))
    weight = np.array([1, 1, 1, 0], np.float32)
    w, err = leap.leap_weights(jnp.asarray(x_j_hat), jnp.asarray(x_j), jnp.asarray(weight), 0.5)
    e = np.mean((x_j_hat.astype(np.float64) - x_j) ** 2, axis=(1, 2, 3))  # by hand, float64
    expected = np.exp(-e[:3] / 0.5) / np.exp(-e[:3] / 0.5).sum()
    np.testing.assert_allclose(err, e, rtol=1e-5)
    np.testing.assert_allclose(w, np.append(expected, 0.0), rtol=1e-5, atol=1e-7)  # padding gets no weight


def _temp_bytes(fn, *args) -> int:
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_leap_update_memory_does_not_grow_with_the_number_of_steps_and_full_backprop_does():
    params = _mlp_params(jax.random.PRNGKey(0), 8 * 8 * 3, hidden=64)
    fns = PolicyFns(None, lambda p, x, s, mb: _mlp(p, x, s), lambda _, x, mb: _reward(x))
    leap_mem, full_mem = {}, {}
    for steps in (4, 16):
        sigmas = schedule.sigmas(steps, 3.0)
        x_T = jnp.zeros((4, 8, 8, 3))
        ro_states = jnp.zeros((4, steps, 8, 8, 3))

        def leap_grad(p, states, x0, i_k, i_j):
            mb = {"x_k": states[jnp.arange(4), i_k], "x_j": states[jnp.arange(4), i_j], "x0": x0, "sigma_k": sigmas[i_k],
                  "sigma_j": sigmas[i_j], "weight": jnp.ones(4)}
            return jax.grad(lambda q: leap.loss(ParamTrees(q, None), mb, fns, {**leap.DEFAULTS, "gamma": 0.5, "tau": 0.01})[0])(p)

        def full_grad(p, x):  # backprop through every Euler step of the trajectory
            def final(q):
                step = lambda x, pair: (x + (pair[1] - pair[0]) * _mlp(q, x, jnp.full((4,), pair[0])), None)  # noqa: E731
                return jax.lax.scan(step, x, (sigmas[:-1], sigmas[1:]))[0]
            return jax.grad(lambda q: -_reward(final(q)).sum())(p)

        idx = jnp.array([0, 1, 0, 2])
        leap_mem[steps] = _temp_bytes(leap_grad, params, ro_states, x_T, idx, idx + 1)
        full_mem[steps] = _temp_bytes(full_grad, params, x_T)
    assert leap_mem[16] == leap_mem[4]
    assert full_mem[16] > full_mem[4]
