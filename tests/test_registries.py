"""Tests driven by the registries: every config file, every objective (docs/math.md §7's on-policy invariants) and
every credit scheme (a uniform advantage stays uniform where docs/math.md says so). A new entry without a case here
fails the coverage assertion, so adding a plug-in means adding its check."""
import glob
import os
import runpy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ml_collections import ConfigDict

from flowrl_jax import config_lib, credit as credit_lib, main, objectives

from configs import common
from flowrl_jax.objectives.batch import IterationData, ParamTrees
from flowrl_jax.rl import plan as plan_lib
from flowrl_jax.rl.policy import PolicyFns
from flowrl_jax.sampling import kernels, rollout, schedule
from flowrl_jax.rl.minibatch import minibatches
from flowrl_jax.sampling.windows import sampler_levels
from tests.conftest import gaussian_velocity

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(p for p in glob.glob(os.path.join(ROOT, "configs", "*.py")) if "def get_config" in open(p).read())  # not common.py


@pytest.mark.parametrize("path", CONFIGS, ids=[os.path.basename(p) for p in CONFIGS])
def test_every_config_file_builds_and_passes_validate(path):
    config = runpy.run_path(path)["get_config"]("")
    assert config.is_locked
    if "world" in config and config.world.name in ("sd3", "flux"):  # a preset for a pipeline folder given on the command line
        with pytest.raises(config_lib.ConfigError, match=r"config\.world\.pipeline is required"):
            main.validate(config)
        return  # test_sd3.py and test_flux.py train one on a tiny pipeline
    main.validate(config)  # its job's required fields, and the job's own checks (train: world, objective, credit)
    if config.job == "train":  # and what needs the world: its prompt sets, checked against the rewards
        plan_lib.make_plan(config)


def test_the_mixgrpo_flash_variant_passes_validate_and_a_wrong_variant_is_named():
    path = os.path.join(ROOT, "configs", "mixgrpo.py")
    config = runpy.run_path(path)["get_config"]("flash")
    assert (config.sampler.window.tail_solver, config.sampler.window.tail_ratio) == ("dpm2m", 0.4)
    main.validate(config)
    with pytest.raises(ValueError, match="configs/mixgrpo.py:flsh: the one variant is 'flash'"):
        runpy.run_path(path)["get_config"]("flsh")


@pytest.mark.parametrize("name", ["leapalign.py", "tp_grpo.py"])
def test_a_coarser_tail_is_refused_where_every_steps_state_is_read(name):
    config = runpy.run_path(os.path.join(ROOT, "configs", name))["get_config"]("")
    config.sampler.window.tail_ratio = 0.4
    with pytest.raises(config_lib.ConfigError, match="LeapAlign and TurningPoint credit read every step's state"):
        main.validate(config)


# ----------------------------------------------------------------------------------------------- objectives
B, G, T = 8, 4, 10
BASE = gaussian_velocity(0.3, 0.6)


def _fns(kind):
    """A 'policy' whose velocity is the exact Gaussian one scaled by theta (a scalar), the ignored condition."""
    velocity = lambda theta, x, sigma, mb=None: theta * BASE(x, sigma)  # noqa: E731

    def mean(theta, mb):
        return kernels.transition(kind, lambda x, s: velocity(theta, x, s), mb["x"], mb["sigma"], mb["sigma_next"], mb["level"],
                                  mb["sigma_1"])

    return PolicyFns(mean, velocity, lambda params, images, mb: -jnp.mean(jnp.square(images - 0.3), axis=(1, 2, 3)))


def _iteration(name, kind):
    """(data, the objective's first minibatch, options) of one iteration with random rewards."""
    config = common.train_config()
    config.objective.name = name
    config.sampler.update(kind=kind, num_steps=T, shift=1.0)
    objective = objectives.get(name)
    options = objectives.resolve_options(config, patch_size=2)
    objective.check(options, config.sampler)
    levels = sampler_levels(config.sampler)
    ro = rollout.rollout(lambda x, s: BASE(x, s), jax.random.normal(jax.random.PRNGKey(0), (B, 4, 4, 2)),
                         schedule.sigmas(T, 1.0), levels, jax.random.PRNGKey(1), kind, patch_size=2)
    rewards = jax.random.uniform(jax.random.PRNGKey(2), (B,))
    sched = rollout.Schedule(schedule.sigmas(T, 1.0), jnp.asarray(levels))
    credit = credit_lib.build(("uniform",))
    adv, _ = credit.apply({"rollout": ro, "schedule": sched, "rewards": rewards, "group_ids": jnp.repeat(jnp.arange(B // G), G),
                           "num_groups": B // G}, credit.init())
    data = IterationData(ro, sched, adv, jnp.zeros((B, 1)), jnp.zeros((B, 1)), jax.random.PRNGKey(4),
                         reward_ids=jnp.zeros((B, 2), jnp.int32), reward_mask=jnp.ones((B, 2), bool))
    slots = objective.slots(options, np.asarray(levels))
    rows, slot, weight = next(minibatches(np.ones(B, bool), slots, B * len(slots), np.random.default_rng(0)))
    mb = objective.pairs(data, jnp.asarray(rows), jnp.asarray(slot), jnp.asarray(weight), jax.random.PRNGKey(3), options)
    return data, mb, options


ON_POLICY_TREES = ParamTrees(1.0, 1.0, old=1.0)  # theta = the reference = the old policy: on policy


def _with(mb, **pairs):
    """`mb` with some per-pair fields replaced."""
    return mb.replace(pairs={**mb.pairs, **pairs})


def _grpo(mb, options, fns):
    mb = _with(mb, adv=jnp.abs(mb["adv"]) + 0.1)  # group advantages average to ~0: a non-zero mean makes the loss check relative
    loss, aux = objectives.get("grpo").loss(ON_POLICY_TREES, mb, fns, options)
    # docs/math.md §7: on policy every ratio is 1 (per-step mean and std over the (sample, step) pairs), nothing is
    # clipped, and the clipped loss is minus the mean advantage. 2e-5: exp of a float32 log-prob difference of
    # two identical computations is exact; the per-step std is a mean of squares of ~1e-7 rounding.
    trained = np.asarray(sampler_levels(ConfigDict({"sde_window": (), "num_steps": T, "noise_level": 0.7, "kind": "sde"}))) > 0
    np.testing.assert_allclose(np.asarray(aux["ratio_mean_per_step"])[trained], 1.0, atol=2e-5)
    assert float(aux["clipfrac"]) == 0.0 and float(aux["kl"]) == 0.0
    np.testing.assert_allclose(float(loss), -float(np.mean(np.asarray(mb["adv"]))), rtol=1e-5)  # ratios 1 +- a few ulp


def _advantage_flow(mb, options, fns):
    _, aux = objectives.get("advantage_flow").loss(ON_POLICY_TREES, mb, fns, options)
    assert float(aux["drift_from_rollout_policy"]) == 0.0  # v_theta = v_old exactly on policy
    # and with no advantage the anchored loss has no gradient at the rollout policy
    zero = _with(mb, adv=jnp.zeros_like(mb["adv"])).replace(shared={**mb.shared, "adv_floor": jnp.zeros(())})
    grad = jax.grad(lambda th: objectives.get("advantage_flow").loss(ParamTrees(th, 1.0, old=1.0), zero, fns, options)[0])(1.0)
    assert float(grad) == 0.0


def _nft(mb, options, fns):
    # On policy the implicit positive and negative policies coincide (v+ = v- = v_old), so the loss does not
    # depend on which samples are positive: flipping every advantage leaves it unchanged (to float rounding).
    loss = lambda m: objectives.get("nft").loss(ON_POLICY_TREES, m, fns, options)[0]  # noqa: E731
    flipped = _with(mb, adv=-mb["adv"])
    assert float(jnp.abs(mb["adv"]).max()) > 0.5
    np.testing.assert_allclose(float(loss(flipped)), float(loss(mb)), rtol=1e-6)


def _leapalign(mb, options, fns):
    # The connectors make the value the real samples' reward: -sum_b w_b R(x0_b), whatever the leaps.
    loss, aux = objectives.get("leapalign").loss(ON_POLICY_TREES, mb, fns, options)
    real = np.asarray(fns.reward(None, mb["x0"], mb))
    np.testing.assert_allclose(float(aux["learned_reward"]), real.mean(), rtol=1e-5)
    assert real.min() - 1e-6 <= -float(loss) <= real.max() + 1e-6  # a convex combination (softmax weights) of the real rewards


ON_POLICY = {"grpo": ("sde", _grpo), "advantage_flow": ("ode", _advantage_flow), "nft": ("ode", _nft), "leapalign": ("ode", _leapalign)}


def test_every_objective_has_an_on_policy_check():
    assert set(ON_POLICY) == set(objectives.OBJECTIVES)


@pytest.mark.parametrize("name", sorted(ON_POLICY))
def test_on_policy_invariant_of_every_objective(name):
    kind, check = ON_POLICY[name]
    _, mb, options = _iteration(name, kind)
    check(mb, options, _fns(kind))


# ------------------------------------------------------------------------------------------ credit schemes
GROUPS = np.repeat(np.arange(2), 4)


def _ro(levels):
    """(a Rollout with the fields credit schemes read, its Schedule)."""
    n = len(levels)
    ro = rollout.Rollout(states=jnp.zeros((8, n, 4, 4, 3)), next_states=None, means=None, stds=None, logp=jnp.zeros((8, n, 4)), x0_hat=None)
    return ro, rollout.Schedule(schedule.sigmas(n, 1.0), jnp.asarray(levels, jnp.float32))


def _group_norm(r, group_std):
    r = np.asarray(r, np.float64)
    mean = np.array([r[GROUPS == g].mean() for g in GROUPS])
    std = np.array([r[GROUPS == g].std() for g in GROUPS]) if group_std else r.std()
    return np.clip((r - mean) / (std + 1e-4), -5, 5)


R = np.array([0.1, 0.5, 0.9, 0.2, 0.3, 0.3, 0.7, 0.4], np.float32)


def _credit_case(name):
    """(chain, extras, levels, the uniform advantage docs/math.md says it leaves [B] or None to skip)."""
    if name == "uniform":  # docs/math.md §3: A[b, t, k] = A[b]
        return ("uniform",), {}, [0.7] * 3, _group_norm(R, group_std=False)
    if name == "spatial":  # equal gradient norms on every token: w = 1, the advantage is unchanged
        grad = jnp.ones((8, 4, 4, 3))
        return ("uniform", "spatial"), {"spatial": {"gradient": grad}}, [0.7] * 3, _group_norm(R, group_std=False)
    if name == "adaptive":  # checked at alpha = 1 below (plain group advantages)
        return ("uniform", "adaptive"), {}, [0.7] * 3, _group_norm(R, group_std=False)
    if name == "stepwise":  # the same Tweedie gain at every step: the per-step normalization gives one advantage per sample
        gains = R - 0.5
        step_rewards = np.cumsum(np.concatenate([np.zeros((8, 1)), np.repeat(gains[:, None], 3, 1)], 1), 1).astype(np.float32)
        return ("stepwise",), {"stepwise": {"step_rewards": jnp.asarray(step_rewards)}}, [0.7] * 3, _group_norm(gains, group_std=False)
    if name == "turning_point":  # one SDE step and a shared x_T per group (equal R_0): Flow-GRPO's advantage, group std
        r0 = np.repeat(np.array([0.4, 0.2], np.float32), 4)[:, None]
        return ("turning_point",), {"turning_point": {"completion_rewards": jnp.asarray(r0)}}, [0.7, 0.0, 0.0], _group_norm(R, group_std=True)
    raise KeyError(name)


def test_every_credit_scheme_has_a_uniformity_case():
    for name in credit_lib.SCHEMES:
        _credit_case(name)


@pytest.mark.parametrize("name", sorted(credit_lib.SCHEMES))
def test_credit_schemes_leave_a_uniform_advantage_uniform(name):
    names, extras, levels, expected = _credit_case(name)
    credit = credit_lib.build(names, {"adaptive": {"alpha": 1.0}})
    ro, sched = _ro(levels)
    adv, _ = credit.apply({"rollout": ro, "schedule": sched, "rewards": jnp.asarray(R), "group_ids": jnp.asarray(GROUPS), "num_groups": 2,
                           **extras}, credit.init())
    adv = np.asarray(adv)
    trained = np.asarray(levels) > 0
    per_sample = np.broadcast_to(adv, (8, len(levels), adv.shape[2]))[:, trained]
    # uniform over the trained steps and tokens, and equal to the closed form; 1e-5: float32 group statistics of 8 values
    np.testing.assert_allclose(per_sample, np.broadcast_to(expected[:, None, None], per_sample.shape), rtol=1e-4, atol=1e-5)
