"""Time to first step: compile time of the train job's rollout and update, before and after a change, cold and with
JAX's persistent compilation cache.

    python benchmarks/compile_time.py [--before fcf6128] [--setups sd35m_v6e8,sd35m_v6e8_noremat,quickstart]
    python benchmarks/compile_time.py --setups quickstart --set world.scan_blocks='"never"'   # this tree only

Setups:
- `sd35m_v6e8`: SD3.5-Medium's Flow-GRPO job on the v6e-8 memory plan (`configs/common.py` MEMORY_PLANS: 8 simulated CPU
  devices, FSDP, remat, bf16, 48 prompts x 24): the job's own jitted rollout (text encoders + the SDE sampler loop)
  and update, lowered on abstract sharded arguments (`memory_plan.build_job`, no weights) and compiled by XLA:CPU.
  Seconds to lower and to compile each.
- `sd35m_v6e8_noremat`: the same without remat (`world.remat=False`, the SD3 world's default).
- `quickstart`: `configs/quickstart.py` on the shipped model: seconds of the first rollout and update call minus a
  second (warm) call, in a fresh process: what a user waits for.

Each (tree, setup) runs in fresh processes, twice on one new cache folder: `cold` (an empty cache, filled on the
way) and `cache` (the second start). `--before REV` adds the same runs on a git worktree of REV (made under /tmp and
removed after), so "before" and "after" are the two trees' own code on the same machine, one after the other. Run it
alone: 2 cores, compile time is CPU time. Prints a table; writes benchmarks/results/compile_time.json (`--out`).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETUPS = {"sd35m_v6e8": ("v6e-8", {}), "sd35m_v6e8_noremat": ("v6e-8", {"world.remat": False}), "quickstart": (None, {})}


def child(setup: str, cache: str, sets: dict) -> dict:
    """One measurement in this process (the tree on sys.path decides before / after)."""
    import jax
    jax.config.update("jax_compilation_cache_dir", cache)
    target, fields = SETUPS[setup]
    fields = {**fields, **sets}
    out = {}
    if target is not None:
        sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
        import memory_plan
        config, plan = memory_plan.target_config(target, 48)
        config.update_from_flattened_dict(fields)
        t0 = time.perf_counter()
        job = memory_plan.build_job(config, jax.devices()[: plan["devices"]])
        out["build_s"] = time.perf_counter() - t0
        for name in ("rollout", "update"):
            t0 = time.perf_counter()
            lowered = getattr(job, name).lower(*getattr(job, name + "_args"))
            t1 = time.perf_counter()
            lowered.compile()
            out[name] = {"lower_s": t1 - t0, "compile_s": time.perf_counter() - t1}
        return out

    import numpy as np
    from flowrl_jax import config_lib, parallel
    from flowrl_jax.rl import plan as plan_lib, programs as programs_lib
    from flowrl_jax.rl.minibatch import minibatches
    config = config_lib.load_config(os.path.join("configs", "quickstart.py"), **fields)
    t_cfg = config.train
    plan = plan_lib.make_plan(config)
    world, mesh = plan.world, plan.mesh
    programs, frozen, initial = programs_lib.build(plan, *world.load())
    prompts = [world.train_prompts[i] for i in world.sample_prompts(t_cfg.prompts_per_iteration, np.random.default_rng(0))
               for _ in range(t_cfg.group_size)]
    ids, mask = parallel.shard_batch(world.tokenize(prompts), mesh)
    levels = plan.levels_at(0)
    state = [initial]  # the update donates it: only the state it returns is live
    calls = {"rollout": lambda: programs.rollout(state[0].params, frozen, ids, mask, jax.random.PRNGKey(0), levels)}
    first = {}
    t0 = time.perf_counter()
    ro, cond, null = jax.block_until_ready(calls["rollout"]())
    first["rollout"] = time.perf_counter() - t0
    batch = t_cfg.prompts_per_iteration * t_cfg.group_size
    adv = jax.numpy.zeros((batch, config.sampler.num_steps, 1), jax.numpy.float32) + 0.5
    data = programs_lib.iteration_data(programs, ro, programs_lib.schedule_of(config.sampler, levels),
                                       parallel.shard_batch(np.asarray(adv), mesh), cond, null, jax.random.PRNGKey(1), prompts)
    rows, step_ids, weight = next(minibatches(np.ones(batch, bool), plan.slots_at(levels), plan.minibatch_size, np.random.default_rng(0)))

    def update():
        state[0], stats = programs.update(state[0], frozen, data, rows, step_ids, weight)
        return stats

    calls["update"] = update
    t0 = time.perf_counter()
    jax.block_until_ready(update())
    first["update"] = time.perf_counter() - t0
    for name, call in calls.items():
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        warm = time.perf_counter() - t0
        out[name] = {"first_call_s": first[name], "warm_call_s": warm, "compile_s": first[name] - warm}
    return out


def run_tree(tree: str, setup: str, sets: list[str]) -> dict:
    """Cold then cached: two fresh processes of `child` in `tree` on one new cache folder."""
    rows = {}
    with tempfile.TemporaryDirectory(prefix="compile_cache_") as cache:
        for state in ("cold", "cache"):
            env = dict(os.environ, PYTHONPATH=tree, JAX_PLATFORMS="cpu",
                       XLA_FLAGS="--xla_force_host_platform_device_count=8" if SETUPS[setup][0] else "")
            cmd = [sys.executable, os.path.abspath(__file__), "--child", setup, "--cache", cache, "--set", *sets]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
            if proc.returncode:
                raise SystemExit(f"{setup} ({state}) failed in {tree}:\n{proc.stderr[-3000:]}")
            rows[state] = {**json.loads(proc.stdout.strip().splitlines()[-1]), "process_s": time.perf_counter() - t0}
            print(f"  {os.path.basename(tree) or tree} {setup} {state}: {rows[state]}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setups", default=",".join(SETUPS))
    parser.add_argument("--before", default="", help="a git revision to measure too (a worktree of it under /tmp)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for this tree's runs")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "compile_time.json"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        from flowrl_jax.config_lib import parse_overrides
        print(json.dumps(child(args.child, args.cache, parse_overrides(args.set))))
        return

    setups = args.setups.split(",")
    trees = {"after": ROOT}
    worktree = None
    if args.before:
        worktree = tempfile.mkdtemp(prefix="compile_before_")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", worktree, args.before], check=True, capture_output=True)
        trees = {"before": worktree, "after": ROOT}
    results = {}
    try:
        for setup in setups:
            for label, tree in trees.items():
                results[f"{setup}/{label}"] = run_tree(tree, setup, args.set if label == "after" else [])
    finally:
        if worktree:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", worktree], check=False)

    print(f"\n{'setup':22s} {'tree':6s} {'phase':8s} {'cold: lower s':>13s} {'compile s':>10s} {'cache: lower s':>14s} {'compile s':>10s}")
    for key, rows in results.items():
        setup, label = key.split("/")
        for phase in ("rollout", "update"):
            cold, warm = rows["cold"][phase], rows["cache"][phase]
            print(f"{setup:22s} {label:6s} {phase:8s} {cold.get('lower_s', float('nan')):13.1f} {cold['compile_s']:10.1f} "
                  f"{warm.get('lower_s', float('nan')):14.1f} {warm['compile_s']:10.1f}")
    from machine import describe  # benchmarks/machine.py (this script's folder)
    env = describe(python=platform.python_version())
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"env": env, "before": args.before, "set": args.set, "results": results}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
