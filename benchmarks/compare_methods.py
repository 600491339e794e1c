"""Every method from the same base model, seed and wall-clock budget on the embedded world.

    python benchmarks/compare_methods.py [--budget_s 240] [--eval_every 8] [--per_category 35] [--methods flow_grpo,spatial]
    python benchmarks/compare_methods.py --methods advantage_flow --merge     # rerun one, keep the others

Each method is its config (`configs/<method>.py`; `flow_grpo` is `configs/quickstart.py`; all start from
`config_lib.embedded_train_config()`) run through the train job in its own workdir under `--workdir`, with
`train.time_budget_s = budget_s` (training wall time; evals and the first, compiling iteration excluded)
and evals every `eval_every` iterations on the first `per_category` test prompts of each category (the
same prompts and eval noise for every method; ODE 20 steps, CFG 3, EMA weights), each also scored by the
shipped learned reward. The base model is evaluated once. Reported per method: iterations done, seconds
per iteration, the GenEval-style strict accuracy and partial score at the largest eval step every method
reached (equal steps) and at the end of the budget (equal wall-clock), and the learned reward at the end.
Writes `benchmarks/results/compare_methods.json`, prints the table (markdown), and draws
`compare_methods.png` (eval score vs training wall-clock per method) and `path_variance.png` (V_t per
step of Flow-GRPO vs lambda-GRPO, from their metrics.jsonl, with the budget).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import runpy
import shutil
import time

import numpy as np

METHODS = {"flow_grpo": "configs/quickstart.py", "spatial": "configs/spatial.py", "stepwise": "configs/stepwise.py",
           "tp_grpo": "configs/tp_grpo.py", "lambda_grpo": "configs/lambda_grpo.py", "adagrpo": "configs/adagrpo.py",
           "lc_grpo": "configs/lc_grpo.py", "advantage_flow": "configs/advantage_flow.py", "nft": "configs/nft.py",
           "leapalign": "configs/leapalign.py"}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def method_config(name: str, args, eval_at_start: bool):
    config = runpy.run_path(os.path.join(ROOT, METHODS[name]))["get_config"]("")
    config.train.update(iterations=10_000, time_budget_s=float(args.budget_s))
    config.eval.update(every=args.eval_every, at_start=eval_at_start, per_category=args.per_category)
    config.checkpoint.update(every=10_000)
    config.seed = args.seed
    return config


def _at(evals: list[dict], step: int) -> dict:
    return next(e for e in evals if e["step"] == step)


def _learned(e: dict) -> str:
    return f"{e['learned_reward']:.3f}" if "learned_reward" in e else "-"


def table(results: dict, base: dict) -> tuple[list[dict], str]:
    common = min(max((e["step"] for e in r["evals"] if e["step"] % r["eval_every"] == 0 and e["step"] > 0), default=0)
                 for r in results.values())  # the largest eval step every method reached (0: none in common)
    b = base["table"]["overall"]
    rows, lines = [], [
        f"| method | iterations | s / iteration | strict @ {common} it | score @ {common} it | strict @ budget | score @ budget "
        "| learned reward @ budget |",
        "|---|---|---|---|---|---|---|---|",
        f"| base model | 0 | - | {b['strict']:.3f} | {b['score']:.3f} | {b['strict']:.3f} | {b['score']:.3f} | {_learned(base)} |"]
    for name, r in results.items():
        end = r["evals"][-1]["table"]["overall"]
        at_k = _at(r["evals"], common)["table"]["overall"] if common else {"strict": float("nan"), "score": float("nan")}
        row = {"method": name, "iterations": r["step"], "s_per_iteration": (r["wall_s"] - r["first_iteration_s"]) / max(r["step"] - 1, 1),
               "first_iteration_s": r["first_iteration_s"],
               "equal_steps": common, "strict_at_steps": at_k["strict"], "score_at_steps": at_k["score"],
               "strict_at_budget": end["strict"], "score_at_budget": end["score"],
               "learned_reward_at_budget": r["evals"][-1].get("learned_reward")}
        rows.append(row)
        lines.append(f"| {name} | {row['iterations']} | {row['s_per_iteration']:.1f} | {at_k['strict']:.3f} | {at_k['score']:.3f} | "
                     f"{end['strict']:.3f} | {end['score']:.3f} | {_learned(r['evals'][-1])} |")
    return rows, "\n".join(lines)


def plot_scores(results: dict, base: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in results.items():
        walls = [0.0] + [e["wall_s"] - r["first_iteration_s"] for e in r["evals"] if e["step"] > 0]
        for ax, metric in zip(axes, ("strict", "score")):
            ys = [base["table"]["overall"][metric]] + [e["table"]["overall"][metric] for e in r["evals"] if e["step"] > 0]
            ax.plot(walls, ys, marker="o", label=name)
    for ax, metric in zip(axes, ("strict", "score")):
        ax.set_xlabel("training wall-clock after the first (compiling) iteration (s)")
        ax.set_ylabel(f"eval overall {metric}")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def path_variance(workdir: str) -> dict:
    """{step: mean V_t over iterations} and the budget from a run's metrics.jsonl."""
    rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    rows = [r for r in rows if "path_variance_budget" in r]
    steps = sorted({int(k.split("_")[-1]) for r in rows for k in r if k.startswith("path_variance/step_")})
    return {"per_step": {t: float(np.mean([r[f"path_variance/step_{t}"] for r in rows])) for t in steps},
            "budget": rows[0]["path_variance_budget"] if rows else float("nan")}


def plot_path_variance(curves: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4))
    for name, c in curves.items():
        ax.plot(list(c["per_step"]), list(c["per_step"].values()), marker="o", label=name)
    budget = next(iter(curves.values()))["budget"]
    ax.axhline(budget, color="k", ls="--", lw=1, label="budget lambda D")
    ax.set_yscale("log")
    ax.set_xlabel("sampler step t")
    ax.set_ylabel("path variance V_t (mean over updates)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget_s", type=float, default=360.0)
    parser.add_argument("--eval_every", type=int, default=8)
    parser.add_argument("--per_category", type=int, default=35)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--workdir", default="/tmp/compare_methods")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    parser.add_argument("--merge", action="store_true",
                        help="rerun only --methods and merge them into the existing compare_methods.json (its base eval kept)")
    args = parser.parse_args()

    from flowrl_jax import train

    names = args.methods.split(",")
    results, base, t0 = {}, None, time.time()
    json_path = os.path.join(args.out, "compare_methods.json")
    if args.merge:
        with open(json_path) as f:
            previous = json.load(f)
        results, base = previous["runs"], previous["base"]
    for i, name in enumerate(names):
        workdir = os.path.join(args.workdir, name)
        shutil.rmtree(workdir, ignore_errors=True)  # a fresh run, not a resume of an earlier one
        out = train.run(method_config(name, args, eval_at_start=(i == 0 and base is None)), workdir)
        if base is None:
            base = out["evals"][0]
        results[name] = {"step": out["step"], "wall_s": out["wall_s"], "first_iteration_s": out["first_iteration_s"],
                         "evals": out["evals"], "eval_every": args.eval_every}
        print(f"{name}: {out['step']} iterations in {results[name]['wall_s']:.0f} s of training")
    rows, text = table(results, base)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    plot_scores(results, base, os.path.join(args.out, "compare_methods.png"))
    curves = {n: path_variance(os.path.join(args.workdir, n)) for n in ("flow_grpo", "lambda_grpo")
              if os.path.exists(os.path.join(args.workdir, n, "metrics.jsonl"))}
    if curves:
        plot_path_variance(curves, os.path.join(args.out, "path_variance.png"))
    with open(json_path, "w") as f:
        json.dump({"args": vars(args), "platform": platform.platform(), "total_s": time.time() - t0, "base": base,
                   "rows": rows, "table_markdown": text, "path_variance": curves, "runs": results}, f, indent=2)


if __name__ == "__main__":
    main()
