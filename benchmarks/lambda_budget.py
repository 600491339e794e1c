"""lambda-GRPO's claim (docs/math.md §4): with every SDE step trained, does the baseline's late-step path variance overshoot
its budget, and does lambda control keep it inside?

    python benchmarks/lambda_budget.py [--iterations 12] [--seeds 0,1,2]
    python benchmarks/lambda_budget.py --shift 3 --beta 0.04 --clip_range 1e-4 --tag shift3   # as the seed paper poses it

Runs Flow-GRPO (`configs/flow_grpo_cpu.py`), GRPO-Guard (`configs/grpo_guard.py`, the seed paper's baseline) and
lambda-GRPO (`configs/lambda_grpo.py`) from the same base, seed and batches with the SDE on steps 0..8 of 10
(`sampler.sde_window=(0, 9)`, independent initial noise per image, every SDE step trained), the rest of each config
unchanged, for `--iterations` iterations each and every seed. From their metrics.jsonl: per step t, the measured path
variance `V_t = mean_e (mu_theta - mu_old)^2 / std_t^2` of the updates (the objective's log, a mean over each
iteration's minibatches; the first minibatch is on-policy, V = 0) against one budget for all, lambda-GRPO's
`lambda D = eps^2 D` (Guard's own clip range, 2e-6, would put it on another scale), and the fraction of (iteration,
step) cells over it, with its mean and 95% t-interval over seeds. Writes `benchmarks/results/lambda_budget.{json,png}`
and prints a table. `--shift`, `--beta`, `--clip_range` set one value for all three (issue 45: Guard's per-step
reweighting `1 / |dt|` is a constant at shift 1, and its config runs beta 0 and clip 2e-6 where the others run 0.04 and
1e-4); `--tag` names the output `lambda_budget_<tag>.{json,png}`. GRPO-Guard's clip then applies to its RatioNorm
ratio, whose log is the standard one times the step's std (`objectives/grpo.py`): the same number, another scale.
`--eval` ends each run with `compare_methods.py`'s eval (all 420 test prompts x 2 samples, CFG 3, its prompts and noise)
and reports the final strict and score, with the gain over that script's cached base eval when one is saved
(`benchmarks/results/compare/base.json`: the same eval of the same base, so the gains are paired).
"""
from __future__ import annotations

import argparse
import json
import os
import runpy
import shutil
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.compare_methods import interval  # noqa: E402  (mean, 95% t half-width over seeds)
RUNS = {"flow_grpo": "configs/flow_grpo_cpu.py", "grpo_guard": "configs/grpo_guard.py", "lambda_grpo": "configs/lambda_grpo.py"}
EVAL = {"per_category": 0, "samples_per_prompt": 2}  # compare_methods.py's default eval settings (its base.json's)
BASE = os.path.join(ROOT, "benchmarks", "results", "compare", "base.json")


def base_eval() -> dict | None:
    """compare_methods.py's cached base eval (overall strict, score, n) when it was made with `EVAL`, else None."""
    if not os.path.exists(BASE):
        return None
    with open(BASE) as f:
        saved = json.load(f)
    return saved["eval"]["table"]["overall"] if saved["settings"] == EVAL else None


def config_for(path: str, args):
    config = runpy.run_path(os.path.join(ROOT, path))["get_config"]("")
    config.sampler.update(sde_window=(0, 9), same_noise_per_group=False)
    config.train.update(iterations=args.iterations, minibatches=4)
    if getattr(args, "shift", None) is not None:
        config.sampler.shift = args.shift
    if getattr(args, "beta", None) is not None:
        config.objective.grpo.beta = args.beta
    if getattr(args, "clip_range", None) is not None:
        config.objective.grpo.clip_range = args.clip_range
    if getattr(args, "eval", False):  # compare_methods.py's eval, at the end only
        config.eval.update(at_start=False, every=0, per_category=EVAL["per_category"], samples_per_prompt=EVAL["samples_per_prompt"], cfg=3.0)
    else:
        config.eval.update(at_start=False, every=0, per_category=1)  # the eval is not what this measures
    config.checkpoint.update(every=10_000)
    config.seed = args.seed
    return config


def per_step(workdir: str) -> dict:
    """One run's per-step path variance `v [iterations, steps]` and its own budget, from its metrics.jsonl."""
    rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    rows = [r for r in rows if "path_variance_budget" in r]
    steps = sorted({int(k.split("_")[-1]) for r in rows for k in r if k.startswith("path_variance/step_")})
    v = np.array([[r[f"path_variance/step_{t}"] for t in steps] for r in rows])  # [iterations, steps]
    return {"steps": steps, "v": v.tolist(), "own_budget": rows[0]["path_variance_budget"], "reward": [r["reward"] for r in rows]}


def summarize(runs: dict, budget: float, base: dict | None = None) -> dict:
    """Per method, over seeds: V_t's mean and max per step, the fraction of cells over `budget` and the last step's
    mean V over the budget, each with its 95% interval; with the runs' final evals, their strict and score (and the gain
    over `base`, the base model's overall eval) with theirs."""
    out = {}
    for name, seeds in runs.items():
        rows = min(len(r["v"]) for r in seeds.values())  # a run that stopped early: compare the iterations all have
        v = np.stack([np.asarray(r["v"])[:rows] for r in seeds.values()])  # [seeds, iterations, steps]
        out[name] = {"steps": next(iter(seeds.values()))["steps"], "mean": v.mean((0, 1)).tolist(), "max": v.max((0, 1)).tolist(),
                     "over_budget_cells": interval((v > budget).mean((1, 2))), "last_step_over_budget": interval(v[:, :, -1].mean(1) / budget)}
        if all("eval" in r for r in seeds.values()):
            for m in ("strict", "score"):
                finals = np.array([r["eval"][m] for r in seeds.values()])
                out[name][f"eval_{m}"] = interval(finals)
                if base is not None:
                    out[name][f"eval_{m}_gain"] = interval(finals - base[m])
    return out


def plot(curves: dict, budget: float, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, c in curves.items():
        line, = ax.plot(c["steps"], c["mean"], marker="o", label=f"{name}: mean over iterations and seeds")
        ax.plot(c["steps"], c["max"], ls=":", color=line.get_color(), label=f"{name}: max")
    ax.axhline(budget, color="k", ls="--", lw=1, label="lambda-GRPO's budget lambda D = eps^2 D")
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
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--workdir", default="/tmp/lambda_budget")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    parser.add_argument("--shift", type=float, default=None, help="the sampler's shift for all three (default: each config's, 1)")
    parser.add_argument("--beta", type=float, default=None, help="one KL beta for all three (default: each config's)")
    parser.add_argument("--clip_range", type=float, default=None, help="one clip range for all three (default: each config's)")
    parser.add_argument("--tag", default="", help="output lambda_budget_<tag>.{json,png} (default lambda_budget.{json,png})")
    parser.add_argument("--eval", action="store_true", help="end each run with compare_methods.py's full eval and report it")
    args = parser.parse_args()
    stem = f"lambda_budget_{args.tag}" if args.tag else "lambda_budget"
    from flowrl_jax.jobs import train

    runs = {name: {} for name in RUNS}
    for seed in (int(s) for s in args.seeds.split(",")):
        for name, path in RUNS.items():
            workdir = os.path.join(args.workdir, f"{name}_seed{seed}")
            shutil.rmtree(workdir, ignore_errors=True)
            args.seed = seed
            out = train.run(config_for(path, args), workdir)
            runs[name][seed] = per_step(workdir)
            if args.eval:
                runs[name][seed]["eval"] = {m: out["evals"][-1]["table"]["overall"][m] for m in ("strict", "score", "n")}
    budget = next(iter(runs["lambda_grpo"].values()))["own_budget"]
    base = base_eval() if args.eval else None
    curves = summarize(runs, budget, base)
    lines = ["| step | " + " | ".join(f"{n} V_t mean / max" for n in curves) + " |", "|---|" + "---|" * len(curves)]
    for i, t in enumerate(next(iter(curves.values()))["steps"]):
        lines.append(f"| {t} | " + " | ".join(f"{c['mean'][i]:.2e} / {c['max'][i]:.2e}" for c in curves.values()) + " |")
    lines.append(f"\nlambda-GRPO's budget lambda D = {budget:.2e}; over {len(runs['lambda_grpo'])} seeds (mean, 95% CI): "
                 "(iteration, step) cells over it " + ", ".join(f"{n} {c['over_budget_cells'][0]:.0%} +- {c['over_budget_cells'][1]:.0%}"
                                                                 for n, c in curves.items())
                 + "; last step's mean V_t / budget " + ", ".join(f"{n} {c['last_step_over_budget'][0]:.2f} +- {c['last_step_over_budget'][1]:.2f}"
                                                                  for n, c in curves.items()))
    if args.eval:
        lines.append("final eval (mean, 95% CI): " + ", ".join(
            f"{n} strict {c['eval_strict'][0]:.3f} +- {c['eval_strict'][1]:.3f}, score {c['eval_score'][0]:.3f} +- {c['eval_score'][1]:.3f}"
            for n, c in curves.items()) + (f" (base strict {base['strict']:.3f}, score {base['score']:.3f})" if base else " (no base eval saved)"))
    print("\n".join(lines))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, stem + ".json"), "w") as f:  # before the plot: a plotting error keeps the numbers
        json.dump({"args": vars(args), "budget": budget, "base_eval": base, "curves": curves, "runs": runs, "table": "\n".join(lines)}, f, indent=1)
    plot(curves, budget, os.path.join(args.out, stem + ".png"))


if __name__ == "__main__":
    main()
