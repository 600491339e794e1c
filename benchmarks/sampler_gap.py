"""The SDE-vs-ODE gap (what LC-GRPO targets): the reward of each kernel's training rollouts against the
ODE sampler's, from the same model, prompts and initial noise.

    python benchmarks/sampler_gap.py [--base shapes32] [--per_category 16] [--group 4] [--noise_level 0.7]

For every kernel (`sde` Flow-GRPO, `cps` Flow-CPS, `lc` LC-GRPO) with the SDE on every step and on the
embedded configs' window (the first two of 10 steps), rollouts as the train job makes them
(`rl/programs.py` `make_rollout`: 10 steps, CFG 3, shift 1) for `per_category` train prompts of each category x
`group` images, scored by the exact evaluator; the gap is kernel minus ODE (negative: the training
rollouts are worse samples than the policy's own ODE sampler). Prints a table, writes
benchmarks/results/sampler_gap.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform

import jax
import numpy as np

from configs import common
from flowrl_jax import rewards, worlds
from flowrl_jax.data import shapes
from flowrl_jax.rl import programs
from flowrl_jax.rl.policy import Policy
from flowrl_jax.sampling.windows import sampler_levels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="shapes32")
    parser.add_argument("--per_category", type=int, default=16)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--noise_level", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args()

    config = common.embedded_train_config()
    config.world.base = args.base
    world = worlds.build(config)
    dit, base = world.load()
    policy = Policy(dit, 0)
    prompts = [p for c in shapes.CATEGORIES for p in [q for q in shapes.load_prompts("train") if q["category"] == c][: args.per_category]]
    rows = [p for p in prompts for _ in range(args.group)]
    ids, mask = world.tokenize(rows)
    score_fn = rewards.build((("shapes_score", 1.0), ("shapes_strict", 0.0)))

    def rollout_reward(kind: str, window) -> dict:
        config = common.embedded_train_config()
        config.sampler.update(kind=kind, sde_window=window, noise_level=args.noise_level, same_noise_per_group=False)
        config.train.group_size = args.group
        fn = jax.jit(programs.make_rollout(policy, world, config).whole)
        ro, _, _ = fn(base["dit"], base, ids, mask, jax.random.PRNGKey(args.seed), sampler_levels(config.sampler))
        _, parts = score_fn(np.asarray(ro.final), rows)
        return {"score": float(parts["shapes_score"].mean()), "strict": float(parts["shapes_strict"].mean())}

    ode = rollout_reward("ode", ())
    results = [{"kernel": "ode", "window": "-", **ode, "gap_score": 0.0, "gap_strict": 0.0}]
    for kind in ("sde", "cps", "lc"):
        for window in ((), (0, 2)):
            r = rollout_reward(kind, window)
            results.append({"kernel": kind, "window": "all 10 steps" if not window else f"steps {window[0]}-{window[0] + window[1] - 1}",
                            **r, "gap_score": r["score"] - ode["score"], "gap_strict": r["strict"] - ode["strict"]})
    print(f"training rollouts vs the ODE sampler: {len(rows)} images ({args.per_category} train prompts per category x {args.group}), "
          f"10 steps, CFG 3, a = {args.noise_level}, same initial noise")
    print("| kernel | SDE steps | score | strict | score - ODE | strict - ODE |\n|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['kernel']} | {r['window']} | {r['score']:.3f} | {r['strict']:.3f} | {r['gap_score']:+.3f} | {r['gap_strict']:+.3f} |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sampler_gap.json"), "w") as f:
        json.dump({"args": vars(args), "platform": platform.platform(), "images": len(rows), "rows": results}, f, indent=2)


if __name__ == "__main__":
    main()
