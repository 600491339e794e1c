"""Signal-to-noise of Flow-GRPO's policy gradient against batch size, at the base model (issue 16).

    python benchmarks/gradient_snr.py [--config configs/flow_grpo_cpu.py[:variant]] [--groups 64] [--null] [--set sampler.cfg=1.0]

A group is one train prompt x G images (the config's group size, sampler, SDE window), drawn as the train loop
draws them. For K groups, each group's on-policy gradient `g_k` of the objective (ratio 1, so the policy term is
`-mean_pairs A grad l`; the KL's gradient is 0 at the reference) w.r.t. the trainable params (the LoRA adapters),
with advantages normalized over all K groups (the config's global std). With `mu = E g` and covariance `Sigma`
over groups:
- `||mu||^2` is estimated without bias as `mean_{i != j} g_i . g_j` (= `||mean_k g_k||^2 - tr(S) / K`, S the sample
  covariance), with a jackknife 95% interval;
- a batch of n groups has gradient SNR `||mu||^2 / (tr Sigma / n)`, so `n* = tr Sigma / ||mu||^2` groups give SNR 1:
  the smallest batch whose update is more signal than noise;
- SNR per second: `seconds_for_snr_1 = n* x` the warm seconds one group costs (its share of a rollout with the reward,
  plus its gradient; medians after the first call, so the compile is left out); `*_at_least` use the interval's
  upper end of `||mu||^2`, a lower bound that stays finite when the interval does not exclude zero;
- `transfer`: the mean cosine of a group's gradient with the mean of the other groups' (how much an update on
  some prompts moves the policy for the others; 0 for unrelated directions).
With `--null` the advantages are shuffled within each group first (the null control): `||mu||^2` must then be 0
within its interval, which checks the estimator. Prints a line and appends it to
`benchmarks/results/gradient_snr.json`.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from flowrl_jax import config_lib, parallel
from flowrl_jax.credit import group
from flowrl_jax.objectives.batch import IterationData, ParamTrees
from flowrl_jax.rl import plan as plan_lib, programs as programs_lib
from flowrl_jax.rl.policy import policy_fns
from flowrl_jax.sampling.windows import sampler_levels

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def group_gradients(config, num_groups: int, null: bool, seed: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """-> ([K, P] the per-group on-policy gradients (module doc), flattened; [K G] rewards; warm seconds per group:
    `rollout_s` (sampling + reward, per rollout / its groups) and `gradient_s` (one group's pairs), each the median over
    calls after the first, so the compile is left out)."""
    t = config.train
    plan = plan_lib.make_plan(config)
    world, mesh = plan.world, plan.mesh
    programs, frozen, state = programs_lib.build(plan, *world.load())
    reward_fn = world.reward_fn(plan.rewards)
    per_rollout = t.prompts_per_iteration
    if num_groups <= per_rollout:
        raise SystemExit(f"--groups {num_groups}: need more than {per_rollout} (two rollouts), so the warm timings leave out the compile")
    rollouts, rewards, rollout_s, gradient_s = [], [], [], []
    for r in range((num_groups + per_rollout - 1) // per_rollout):
        drawn = world.sample_prompts(per_rollout, np.random.default_rng([seed, r]))
        prompts = [world.train_prompts[i] for i in drawn for _ in range(t.group_size)]
        ids, mask = parallel.shard_batch(world.tokenize(prompts), mesh)
        levels = plan.levels_at(r)  # the window of iteration r under the config's schedule (Fast: random; MixGRPO: sliding)
        start = time.perf_counter()
        ro, cond, null_cond = programs.rollout(state.params, frozen, ids, mask, jax.random.PRNGKey(1000 * seed + r), levels)
        rollouts.append((ro, programs_lib.schedule_of(config.sampler, levels), cond, null_cond, plan.slots_at(levels)))
        rewards.append(np.asarray(reward_fn(np.asarray(world.decode(frozen, ro.final)), prompts)[0], np.float32))
        rollout_s.append((time.perf_counter() - start) / per_rollout)
    reward = np.concatenate(rewards)
    group_ids = np.repeat(np.arange(len(reward) // t.group_size), t.group_size)
    adv = group.group_advantages(jnp.asarray(reward), jnp.asarray(group_ids), len(reward) // t.group_size,
                                 config.advantage.global_std, config.advantage.clip,
                                 config.advantage.std_eps, config.advantage.std_ddof)
    if null:
        adv = group.permute_within_groups(adv, jnp.asarray(group_ids), jax.random.PRNGKey(seed + 7))
    adv = np.asarray(adv)
    policy = programs.policy
    objective, options = plan.objective, plan.loss_options(policy.dit.token_patch)
    fns = policy_fns(policy, config.sampler, None, None, options.get("detach_uncond", False))

    @jax.jit
    def grad(params, frozen, data, rows, slots, weight):
        mb = objective.pairs(data, rows, slots, weight, jax.random.PRNGKey(0), options)
        loss = lambda p: objective.loss(ParamTrees(policy.variables(p, frozen["dit"]), {"params": frozen["dit"]}), mb, fns, options)[0]  # noqa: E731
        return ravel_pytree(jax.grad(loss)(params))[0]

    grads = []
    batch = per_rollout * t.group_size
    for k in range(num_groups):
        ro, sched, cond, null_cond, trained = rollouts[k // per_rollout]
        first = (k % per_rollout) * t.group_size
        rows, slots = np.meshgrid(np.arange(first, first + t.group_size), trained, indexing="ij")
        a = np.zeros((batch, 1, 1), np.float32)
        a[:, 0, 0] = adv[(k // per_rollout) * batch:(k // per_rollout + 1) * batch]
        data = IterationData(ro, sched, jnp.asarray(a), cond, null_cond, jax.random.PRNGKey(0))
        start = time.perf_counter()
        grads.append(np.asarray(grad(state.params, frozen, data, rows.ravel().astype(np.int32),
                                     slots.ravel().astype(np.int32), np.ones(rows.size, np.float32))))
        gradient_s.append(time.perf_counter() - start)
    warm = {"rollout_s": float(np.median(rollout_s[1:])), "gradient_s": float(np.median(gradient_s[1:]))}
    return np.stack(grads), reward, warm


def signal_and_noise(g: np.ndarray) -> dict:
    """||mu||^2, tr Sigma, n* and the leave-one-out transfer from per-group gradients `g [K, P]`. `||mu||^2` is the
    U-statistic `mean_{i != j} g_i . g_j` (equal to `||mean g||^2 - tr(S) / K`, unbiased), its 95% interval from the
    jackknife's standard error (normal quantile 1.96)."""
    k = g.shape[0]
    gram = g.astype(np.float64) @ g.T.astype(np.float64)
    off = gram.sum() - np.trace(gram)
    mu2 = off / (k * (k - 1))
    trace = float(np.trace(gram) / k - gram.sum() / k**2) * k / (k - 1)  # sum_i ||g_i - mean||^2 / (K - 1)
    row = gram.sum(1) - np.diag(gram)  # sum_{j != i} g_i . g_j
    loo = (off - 2 * row) / ((k - 1) * (k - 2))  # the statistic without group i
    se = float(np.sqrt((k - 1) / k * np.sum((loo - loo.mean()) ** 2)))
    others = (g.sum(0)[None] - g) / (k - 1)
    cos = (g * others).sum(1) / (np.linalg.norm(g, axis=1) * np.linalg.norm(others, axis=1) + 1e-30)
    return {"mu2": float(mu2), "mu2_ci95": [float(mu2 - 1.96 * se), float(mu2 + 1.96 * se)], "trace_sigma": trace,
            "groups_for_snr_1": trace / mu2 if mu2 > 0 else float("inf"), "transfer_cosine": float(cos.mean()),
            "transfer_cosine_se": float(cos.std(ddof=1) / np.sqrt(k))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/flow_grpo_cpu.py")
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--null", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], help="a config override key=value (Python literal), repeatable")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "gradient_snr.json"))
    args = parser.parse_args()
    path, _, variant = args.config.partition(":")  # `configs/mixgrpo.py:flash`, as main's --config
    overrides = config_lib.parse_overrides(args.set)
    config = config_lib.load_config(os.path.join(ROOT, path), variant, **overrides)
    t0 = time.time()
    g, reward, warm = group_gradients(config, args.groups, args.null, args.seed)
    stats = signal_and_noise(g)
    per_group = warm["rollout_s"] + warm["gradient_s"]  # warm seconds of sampling, reward and gradient for one group
    hi = stats["mu2_ci95"][1]
    out = {"config": args.config, "overrides": overrides, "null": args.null, "groups": args.groups, "seed": args.seed,
           "group_size": config.train.group_size, "trained_steps": int(np.sum(np.asarray(sampler_levels(config.sampler)) > 0)),
           "reward_mean": float(reward.mean()),
           **stats, "groups_for_snr_1_at_least": stats["trace_sigma"] / hi if hi > 0 else float("inf"),
           "rollout_s_per_group": warm["rollout_s"], "gradient_s_per_group": warm["gradient_s"],
           "seconds_for_snr_1": stats["groups_for_snr_1"] * per_group,
           "seconds_for_snr_1_at_least": stats["trace_sigma"] / hi * per_group if hi > 0 else float("inf"),
           "wall_s": time.time() - t0, "platform": platform.platform()}
    print(json.dumps(out))
    runs = json.load(open(args.out)) if os.path.exists(args.out) else []
    with open(args.out, "w") as f:
        json.dump(runs + [out], f, indent=1)


if __name__ == "__main__":
    main()
