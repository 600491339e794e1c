"""Goodput on paper: the share of a slice's time that trains, per memory plan of `configs/sd35m_pickscore.py`, against
loading and compiling, the evals, the checkpoints' blocking part, and preemptions with their recovery.

    python benchmarks/goodput_on_paper.py [--mfu 0.35] [--preemptions_per_day 1] [--out benchmarks/results/goodput_on_paper.json]

From `benchmarks/results/throughput_on_paper.json` (FLOPs per image; the MMDiT forward F and the VAE decode),
`benchmarks/results/checkpoint_cost.json` (what a save blocks the loop, measured) and the preset itself (iterations,
eval cadence and steps, checkpoint cadence, each plan's chips). Per plan, at the stated utilisation:
  iteration   1,152 images x FLOPs per image / (MFU x the slice's peak)
  eval        test prompts x (eval steps x 2 (CFG) x F + decode + text) / (MFU x peak), sharded over every chip;
              at the start, every `eval.every` iterations and at the end
  checkpoint  every `checkpoint.every` iterations, the blocking part (asynchronous saves)
  preemption  `--preemptions_per_day` x the run's days, each costing the iteration in flight (at most one: a checkpoint
              every iteration) + the recovery (ASSUMED below: not measured on Google's service) + loading and a
              compile from the persistent cache
ASSUMED marks figures that no one has measured on the hardware; change them on the command line or in the table.
"""
from __future__ import annotations

import argparse
import json
import os

from configs import common
from machine import describe  # noqa: E402  (benchmarks/)
from throughput_on_paper import CHIPS  # noqa: E402

CHIP_OF = {"v5p": "TPU v5p", "v6e": "TPU v6e", "gpu": "H100/H200 SXM"}
TEST_PROMPTS = 2048  # flow_grpo's PickScore test set (dataset/pickscore/test.txt), the preset's eval
TEXT_TFLOP = 1.3102  # CLIP-L + CLIP-G + T5-XXL per prompt at 128 T5 tokens (benchmarks/text_cache.py), once per eval row
# ASSUMED (not measured on a TPU or GPU; stated so that the table can be recomputed with better figures):
LOAD_S = 120            # SD3.5-M's pipeline and the reward model from local disk, placed on the mesh
COMPILE_FIRST_S = 600   # XLA compiles the rollout, decode, update and eval programs at SD3.5-M's shapes
COMPILE_CACHED_S = 120  # a restart reads them from the persistent compilation cache (config.compilation_cache: the workdir)
RECOVERY_S = {          # tpu_scripts/supervise.sh + recover.sh after a preemption (the drill checked the logic, on a stand-in)
    "detect": 30,       # supervise.sh polls every POLL=60 s: half of it on average
    "delete": 120, "create": 300,  # a slice's delete and create (no queueing for capacity counted)
    "stage": 120,       # the pipeline folder (~16 GB) and the prompts from a bucket to every host's disk
    "setup": 180,       # uv installs requirements-tpu.lock into a fresh venv
}


def plan_rows(config, plan: dict, paper: dict, blocking_s: float, mfu: float, per_day: float) -> dict:
    """One plan's seconds by activity and its goodput (training / all)."""
    family = next(k for k in CHIP_OF if k in plan["name"])
    peak = CHIPS[CHIP_OF[family]] * plan["devices"] * mfu  # FLOP/s the slice reaches
    t, e, c = config.train, config.eval, config.checkpoint
    images = t.prompts_per_iteration * t.group_size
    iteration_s = images * paper["per_image_TFLOP"]["total"] * 1e12 / peak
    forward, decode = paper["mmdit_forward_GFLOP"]["hand"] * 1e9, paper["vae_decode_GFLOP"] * 1e9
    rows = -(-TEST_PROMPTS * e.samples_per_prompt // e.batch_size) * e.batch_size  # the last batch padded
    eval_s = rows * (e.num_steps * 2 * forward + decode + TEXT_TFLOP * 1e12) / peak
    evals = int(e.at_start) + t.iterations // e.every + (t.iterations % e.every != 0)
    saves = t.iterations // c.every
    seconds = {"train": t.iterations * iteration_s, "load_compile": LOAD_S + COMPILE_FIRST_S, "eval": evals * eval_s,
               "checkpoint": saves * blocking_s}
    recovery = sum(RECOVERY_S.values()) + LOAD_S + COMPILE_CACHED_S
    per_preemption = iteration_s * c.every + recovery  # the work since the last save, at most `every` iterations, redone
    preemptions = per_day * sum(seconds.values()) / 86400
    seconds["preemptions"] = preemptions * per_preemption
    total = sum(seconds.values())
    return {"chips": plan["devices"], "chip": CHIP_OF[family], "iteration_s": iteration_s, "eval_s": eval_s, "evals": evals,
            "checkpoint_every": c.every, "checkpoint_share_of_iteration": blocking_s / iteration_s,
            "preemptions": preemptions, "per_preemption_s": per_preemption, "seconds": seconds, "total_h": total / 3600,
            "shares": {k: v / total for k, v in seconds.items()}, "goodput": seconds["train"] / total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mfu", type=float, default=0.35)
    parser.add_argument("--preemptions_per_day", type=float, default=1.0)
    parser.add_argument("--out", default="benchmarks/results/goodput_on_paper.json")
    args = parser.parse_args()
    with open("benchmarks/results/throughput_on_paper.json") as f:
        paper = json.load(f)
    with open("benchmarks/results/checkpoint_cost.json") as f:
        blocking_s = json.load(f)["blocking_s"]
    result = {"mfu": args.mfu, "preemptions_per_day": args.preemptions_per_day, "test_prompts": TEST_PROMPTS,
              "checkpoint_blocking_s": blocking_s, "assumed": {"load_s": LOAD_S, "compile_first_s": COMPILE_FIRST_S,
                                                              "compile_cached_s": COMPILE_CACHED_S, "recovery_s": RECOVERY_S},
              "plans": {}, "env": describe()}
    print(f"goodput on paper, configs/sd35m_pickscore.py, MFU {args.mfu:.0%}, {args.preemptions_per_day:g} preemption(s) per day")
    print(f"{'plan':7s} {'chips':>5s} {'iter s':>7s} {'eval s':>7s} {'run h':>6s} {'train':>6s} {'load+compile':>12s} {'eval':>6s} "
          f"{'ckpt':>6s} {'preempt':>7s} {'a preemption, s':>15s}")
    for name, plan in common.MEMORY_PLANS.items():
        config = common.sd35m_train_config(rewards=(("pickscore", 1.0),), plan=name)
        r = plan_rows(config, {**plan, "name": name}, paper, blocking_s, args.mfu, args.preemptions_per_day)
        result["plans"][name] = r
        s = r["shares"]
        print(f"{name:7s} {r['chips']:5d} {r['iteration_s']:7.1f} {r['eval_s']:7.0f} {r['total_h']:6.1f} {s['train']:6.1%} "
              f"{s['load_compile']:12.1%} {s['eval']:6.1%} {s['checkpoint']:6.2%} {s['preemptions']:7.1%} {r['per_preemption_s']:15.0f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
