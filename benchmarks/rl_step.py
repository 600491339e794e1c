"""Throughput of one Flow-GRPO iteration's parts for a train config (default: Flow-GRPO at the CPU budget).

    python benchmarks/rl_step.py [--config configs/flow_grpo_cpu.py] [--repeats 3] [--set key=value ...]
    python benchmarks/rl_step.py --set objective.grpo.detach_uncond=False   # both CFG branches trained

Times (medians of `--repeats` after one warm-up call, `block_until_ready`) the jit-compiled rollout
(B = prompts x group images, T steps, CFG, the SDE window) and one update (a minibatch of (sample, step)
pairs: the policy's kernel mean with CFG, forward + backward, plus the reference forward when beta > 0),
and the host reward. `--set` overrides config fields (values parsed as Python literals). Prints a table; writes
benchmarks/results/rl_step.json (`--out`).
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import runpy
import statistics
import time

import jax
import numpy as np

from flowrl_jax import parallel, rewards
from flowrl_jax.rl import plan as plan_lib, programs as programs_lib
from flowrl_jax.rl.minibatch import minibatches


def _median(fn, repeats: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _parse_override(item: str) -> tuple:
    key, sep, value = item.partition("=")
    if not sep:
        raise SystemExit(f"--set {item!r}: expected KEY=VALUE, e.g. objective.grpo.detach_uncond=False")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value  # a plain string


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/flow_grpo_cpu.py")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "rl_step.json"))
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides, e.g. train.group_size=24")
    args = parser.parse_args()
    config = runpy.run_path(args.config)["get_config"]("")
    overrides = dict(_parse_override(item) for item in args.set)
    config.update_from_flattened_dict(overrides)
    t_cfg, s_cfg = config.train, config.sampler
    plan = plan_lib.make_plan(config)
    world, mesh = plan.world, plan.mesh
    programs, frozen, state = programs_lib.build(plan, *world.load())
    batch = t_cfg.prompts_per_iteration * t_cfg.group_size
    prompts = [world.train_prompts[i] for i in world.sample_prompts(t_cfg.prompts_per_iteration, np.random.default_rng(0))
               for _ in range(t_cfg.group_size)]
    ids, mask = parallel.shard_batch(world.tokenize(prompts), mesh)
    levels = plan.levels_at(0)
    sched = programs_lib.schedule_of(s_cfg, levels)
    slots = plan.slots_at(levels)
    rollout = lambda: programs.rollout(state.params, frozen, ids, mask, jax.random.PRNGKey(0), levels)  # noqa: E731
    rollout_s = _median(rollout, args.repeats)
    ro, cond, null = rollout()
    reward_fn = rewards.build(plan.rewards)
    images = np.asarray(ro.final)
    t0 = time.perf_counter()
    reward, _ = reward_fn(images, prompts)
    reward_s = time.perf_counter() - t0
    gids = np.repeat(np.arange(t_cfg.prompts_per_iteration, dtype=np.int32), t_cfg.group_size)
    ctx = programs_lib.credit_context(programs, world, mesh, frozen, state.params, ro, sched, cond, null, prompts, reward_fn)
    adv, _, keep = programs.credit(ro, sched, parallel.shard_batch(reward, mesh), parallel.shard_batch(gids, mesh),
                                   t_cfg.prompts_per_iteration, state.credit, plan.credit.prepare(ctx), jax.random.PRNGKey(0))
    rows, step_ids, weight = next(minibatches(np.ones(batch, bool), slots, plan.minibatch_size, np.random.default_rng(0)))
    data = programs_lib.iteration_data(programs, ro, sched, adv, cond, null, jax.random.PRNGKey(1), prompts)

    def update():
        nonlocal state
        state, stats = programs.update(state, frozen, data, rows, step_ids, weight)  # donates the state it was given
        return stats

    update_s = _median(update, args.repeats)
    pairs = plan.minibatch_size
    per_iteration = rollout_s + reward_s + t_cfg.num_inner_epochs * t_cfg.minibatches * update_s
    row = dict(config=args.config, overrides={k: repr(v) for k, v in overrides.items()}, batch=batch, num_steps=s_cfg.num_steps,
               trained_steps=len(slots), cfg=s_cfg.cfg,
               beta=config.objective.grpo.beta, rollout_s=rollout_s, rollout_images_per_s=batch / rollout_s,
               rollout_dit_calls_per_s=batch * s_cfg.num_steps * (2 if s_cfg.cfg != 1 else 1) / rollout_s,
               reward_s=reward_s, update_pairs=pairs, update_s=update_s, update_pairs_per_s=pairs / update_s,
               iteration_s=per_iteration)
    print(f"{'config':24s} {'B':>4s} {'T':>3s} {'trained':>7s} {'rollout s':>9s} {'img/s':>7s} {'reward s':>8s} "
          f"{'pairs':>6s} {'update s':>8s} {'pairs/s':>8s} {'iter s':>7s}")
    print(f"{args.config:24s} {batch:4d} {s_cfg.num_steps:3d} {len(slots):7d} {rollout_s:9.2f} "
          f"{row['rollout_images_per_s']:7.1f} {reward_s:8.3f} {pairs:6d} {update_s:8.2f} {row['update_pairs_per_s']:8.1f} {per_iteration:7.1f}")
    from machine import describe  # benchmarks/machine.py (this script's folder)
    env = describe(jax=jax.__version__, backend=jax.default_backend(), devices=jax.device_count())
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"env": env, "rows": [row]}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
