"""lambda-GRPO's claim (SPEC §4): with every SDE step trained, does the baseline's late-step path variance overshoot
its budget, and does lambda control keep it inside?

    python benchmarks/lambda_budget.py [--iterations 12] [--seed 0]

Runs Flow-GRPO and lambda-GRPO (`configs/lambda_grpo.py`) from the same base, seed and batches with the SDE on steps
0..8 of 10 (`sampler.sde_window=(0, 9)`, independent initial noise per image), the rest of the embedded budget
unchanged, for `--iterations` iterations each. From their metrics.jsonl: per step t, the measured path variance
`V_t = mean_e (mu_theta - mu_old)^2 / std_t^2` of the updates (the objective's log, a mean over each iteration's
minibatches; the first minibatch is on-policy, V = 0) against the budget `lambda D = eps^2 D`, and the fraction of
(iteration, step) cells over it. Writes `benchmarks/results/lambda_budget.{json,png}` and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import runpy
import shutil

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = {"flow_grpo": "configs/flow_grpo_cpu.py", "grpo_guard": "configs/grpo_guard.py", "lambda_grpo": "configs/lambda_grpo.py"}


def config_for(path: str, args):
    config = runpy.run_path(os.path.join(ROOT, path))["get_config"]("")
    config.sampler.update(sde_window=(0, 9), same_noise_per_group=False)
    config.train.update(iterations=args.iterations, minibatches=4)
    config.eval.update(at_start=False, every=0, per_category=1)  # the eval is not what this measures
    config.checkpoint.update(every=10_000)
    config.seed = args.seed
    return config


def per_step(workdir: str) -> dict:
    rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    rows = [r for r in rows if "path_variance_budget" in r]
    steps = sorted({int(k.split("_")[-1]) for r in rows for k in r if k.startswith("path_variance/step_")})
    v = np.array([[r[f"path_variance/step_{t}"] for t in steps] for r in rows])  # [iterations, steps]
    budget = rows[0]["path_variance_budget"]
    return {"steps": steps, "mean": v.mean(0).tolist(), "max": v.max(0).tolist(), "budget": budget,
            "over_budget_cells": float(np.mean(v > budget)), "over_budget_fraction": [r.get("over_budget_fraction", 0.0) for r in rows],
            "reward": [r["reward"] for r in rows]}


def plot(curves: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, c in curves.items():
        line, = ax.plot(c["steps"], c["mean"], marker="o", label=f"{name}: mean over iterations")
        ax.plot(c["steps"], c["max"], ls=":", color=line.get_color(), label=f"{name}: max")
    ax.axhline(next(iter(curves.values()))["budget"], color="k", ls="--", lw=1, label="budget lambda D = eps^2 D")
    ax.set_yscale("log")
    ax.set_xlabel("sampler step t (SDE on 0..8)")
    ax.set_ylabel("path variance V_t of an update")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default="/tmp/lambda_budget")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = parser.parse_args()
    from flowrl_jax import train

    curves = {}
    for name, path in RUNS.items():
        workdir = os.path.join(args.workdir, name)
        shutil.rmtree(workdir, ignore_errors=True)
        train.run(config_for(path, args), workdir)
        curves[name] = per_step(workdir)
    lines = ["| step | " + " | ".join(f"{n} V_t mean / max" for n in curves) + " |", "|---|" + "---|" * len(curves)]
    for i, t in enumerate(next(iter(curves.values()))["steps"]):
        lines.append(f"| {t} | " + " | ".join(f"{c['mean'][i]:.2e} / {c['max'][i]:.2e}" for c in curves.values()) + " |")
    budget = next(iter(curves.values()))["budget"]
    lines.append(f"\nbudget lambda D = {budget:.2e}; (iteration, step) cells over it: "
                 + ", ".join(f"{n} {c['over_budget_cells']:.0%}" for n, c in curves.items()))
    print("\n".join(lines))
    os.makedirs(args.out, exist_ok=True)
    plot(curves, os.path.join(args.out, "lambda_budget.png"))
    with open(os.path.join(args.out, "lambda_budget.json"), "w") as f:
        json.dump({"args": vars(args), "curves": curves, "table": "\n".join(lines)}, f, indent=1)


if __name__ == "__main__":
    main()
