"""Every method from the same base model at an equal wall-clock budget, several seeds, with confidence intervals.

    python benchmarks/compare_methods.py --methods flow_grpo,flow_grpo_null --seeds 0,1,2 [--budget_s 300]
    python benchmarks/compare_methods.py --report                  # only re-aggregate the runs already there

Each entry of `ENTRIES` is a config (`configs/<method>.py`, all from `configs/common.py` embedded_train_config())
plus overrides; `<name>_null` entries are the null control (advantages shuffled within each group,
`advantage.null_control`): the same run with the expected policy gradient at zero, so learning can be
told from drift. Every run trains for `train.time_budget_s = budget_s` of training wall time (evals and
the first, compiling iteration excluded) and is evaluated every `eval_every` iterations and at the end on
the test prompts (`--per_category 0`: all 420, x `samples_per_prompt`), ODE 20 steps, CFG 3, EMA weights,
with the same prompts and eval noise (`eval.noise_seed`) for every method and seed; the base model is
evaluated once with the same prompts and noise, so each run's gain over it is paired.

Each finished run is written at once to `<out>/runs/<name>/seed_<s>.json` (an existing one is kept unless
`--rerun`), so a table can be filled over several sessions and merged. The report aggregates every run
under `<out>/runs`: per entry the mean final gain over the base in strict accuracy and partial score, with a
95% confidence interval over seeds (Student t, n - 1 degrees of freedom), and for entries with a null
control the gain over it (Welch t). `<out>/compare_methods.{json,md,png}`: the table and eval strict
against training wall-clock per entry (mean over seeds, band = min..max).
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import platform
import runpy
import shutil
import time

import numpy as np
from scipy import stats as scipy_stats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = {"flow_grpo": "configs/flow_grpo_cpu.py", "spatial": "configs/spatial.py", "stepwise": "configs/stepwise.py",
           "tp_grpo": "configs/tp_grpo.py", "lambda_grpo": "configs/lambda_grpo.py", "adagrpo": "configs/adagrpo.py",
           "lc_grpo": "configs/lc_grpo.py", "advantage_flow": "configs/advantage_flow.py", "nft": "configs/nft.py",
           "leapalign": "configs/leapalign.py", "flow_grpo_fast": "configs/flow_grpo_fast.py", "grpo_guard": "configs/grpo_guard.py",
           "mixgrpo": "configs/mixgrpo.py"}
ENTRIES = {name: (path, {}) for name, path in METHODS.items()}
for _name in ("flow_grpo", "flow_grpo_fast", "grpo_guard", "mixgrpo"):  # issue 33: the policy-gradient family's null controls
    ENTRIES[_name + "_null"] = (METHODS[_name], {"advantage.null_control": True})
ENTRIES["flow_grpo_upstream"] = ("configs/flow_grpo.py", {})  # upstream's recipe (192 images, steps 0-8) at this budget
ENTRIES["flow_grpo_upstream_null"] = ("configs/flow_grpo.py", {"advantage.null_control": True})
# Issue 33 item 8 (benchmarks/gpu_policy_gradient.sh): upstream's 48 prompts x 24 per iteration, and Fast at 48 prompts.
for _name, (_path, _overrides) in {"flow_grpo_upstream48": ("configs/flow_grpo.py", {}), "flow_grpo_fast48": (METHODS["flow_grpo_fast"], {})}.items():
    ENTRIES[_name] = (_path, {**_overrides, "train.prompts_per_iteration": 48})
    ENTRIES[_name + "_null"] = (_path, {**_overrides, "train.prompts_per_iteration": 48, "advantage.null_control": True})
# The levers of issue 16 on Flow-GRPO (WORKSPACE_NOTES.md "Making the policy gradient learn"): name -> overrides.
LEVERS = {
    "grpo_cfg1": {"sampler.cfg": 1.0},
    "grpo_cfg1_p16": {"sampler.cfg": 1.0, "train.prompts_per_iteration": 16},
    "grpo_cfg1_p32_g6": {"sampler.cfg": 1.0, "train.prompts_per_iteration": 32, "train.group_size": 6},
    "grpo_p16_mb1": {"train.prompts_per_iteration": 16, "train.minibatches": 1},
    "grpo_window9": {"sampler.sde_window": (0, 9), "sampler.same_noise_per_group": False, "train.minibatches": 4},
    "grpo_epochs4": {"train.num_inner_epochs": 4},
    "grpo_strict_weighted": {"train.rewards": (("shapes_score", 1.0), ("shapes_strict", 1.0))},
}
for _name, _overrides in LEVERS.items():
    ENTRIES[_name] = (METHODS["flow_grpo"], _overrides)
    ENTRIES[_name + "_null"] = (METHODS["flow_grpo"], {**_overrides, "advantage.null_control": True})


def entry_config(name: str, seed: int, args, eval_at_start: bool = False):
    path, overrides = ENTRIES[name]
    config = runpy.run_path(os.path.join(ROOT, path))["get_config"]("")
    config.update_from_flattened_dict({**overrides, **getattr(args, "overrides", {})})
    config.train.update(iterations=10_000, time_budget_s=float(args.budget_s))
    config.eval.update(every=args.eval_every, at_start=eval_at_start, per_category=args.per_category,
                       samples_per_prompt=args.samples_per_prompt, cfg=getattr(args, "eval_cfg", 3.0))  # one eval for every
    # method, the base's: the CFG-free configs (Fast, NFT) evaluate at CFG 1 on their own, as upstream
    config.checkpoint.update(every=10_000)
    config.seed = seed
    return config


def eval_settings(args) -> dict:
    """What makes two evals comparable: the same prompts, samples and noise (and `--set` overrides, when any, so that a
    trial at toy shapes never merges with real runs)."""
    settings = {"per_category": args.per_category, "samples_per_prompt": args.samples_per_prompt}
    if getattr(args, "eval_cfg", 3.0) != 3.0:  # the default is left out, so the cached base eval of 3.0 still matches
        settings["eval_cfg"] = args.eval_cfg
    settings = {**settings, "overrides": args.overrides} if getattr(args, "overrides", None) else settings
    return json.loads(json.dumps(settings))  # as a run's JSON reads it back (tuples as lists), so the two compare equal


def base_eval(args) -> dict:
    """The base model's eval under `eval_settings(args)` (the run of `train` with 0 iterations), cached."""
    path = os.path.join(args.out, "base.json")
    if os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
        if saved["settings"] == eval_settings(args):
            return saved["eval"]
        raise SystemExit(f"{path} was evaluated with {saved['settings']}, not {eval_settings(args)}: use another --out")
    from flowrl_jax.jobs import train

    config = entry_config("flow_grpo", 0, args, eval_at_start=True)
    config.train.iterations = 0
    out = train.run(config, os.path.join(args.workdir, "base"))
    os.makedirs(args.out, exist_ok=True)
    with open(path, "w") as f:
        json.dump({"settings": eval_settings(args), "eval": out["evals"][0]}, f, indent=2)
    return out["evals"][0]


def run_one(name: str, seed: int, args) -> dict:
    from flowrl_jax.jobs import train

    workdir = os.path.join(args.workdir, f"{name}_seed{seed}")
    shutil.rmtree(workdir, ignore_errors=True)  # a fresh run, not a resume of an earlier one
    config = entry_config(name, seed, args)
    out = train.run(config, workdir)
    if out["wall_s"] - out["first_iteration_s"] < args.budget_s:  # stopped early (SIGTERM/SIGINT saves and returns)
        raise SystemExit(f"{name} seed {seed} stopped after {out['step']} iterations, before its {args.budget_s:.0f} s budget: "
                         "not recorded; run the same command again")
    return {"name": name, "seed": seed, "overrides": {k: list(v) if isinstance(v, tuple) else v for k, v in ENTRIES[name][1].items()},
            "config_file": ENTRIES[name][0], "budget_s": args.budget_s, "settings": eval_settings(args),
            "platform": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M"), "step": out["step"],
            "wall_s": out["wall_s"], "first_iteration_s": out["first_iteration_s"], "evals": out["evals"],
            "train_reward": train_rewards(workdir)}


def train_rewards(workdir: str) -> list[float]:
    path = os.path.join(workdir, "metrics.jsonl")
    return [r["reward"] for r in map(json.loads, open(path)) if "reward" in r] if os.path.exists(path) else []


def interval(values, confidence: float = 0.95) -> tuple[float, float]:
    """(mean, half-width) of the Student-t interval over `values` (NaN half-width for one value)."""
    v = np.asarray(values, float)
    if v.size < 2:
        return float(v.mean()), float("nan")
    return float(v.mean()), float(scipy_stats.t.ppf(0.5 + confidence / 2, v.size - 1) * v.std(ddof=1) / np.sqrt(v.size))


def welch(a, b, confidence: float = 0.95) -> tuple[float, float]:
    """(mean(a) - mean(b), half-width) of Welch's t interval."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    if a.size < 2 or b.size < 2:
        return float(a.mean() - b.mean()), float("nan")
    va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
    dof = (va + vb) ** 2 / (va**2 / (a.size - 1) + vb**2 / (b.size - 1)) if va + vb > 0 else 1.0
    return float(a.mean() - b.mean()), float(scipy_stats.t.ppf(0.5 + confidence / 2, dof) * np.sqrt(va + vb))


def load_runs(out: str, settings: dict) -> dict:
    runs = {}
    for path in sorted(glob.glob(os.path.join(out, "runs", "*", "seed_*.json"))):
        with open(path) as f:
            r = json.load(f)
        if r["settings"] == settings:
            runs.setdefault(r["name"], []).append(r)
    return runs


def _fmt(mean: float, half: float) -> str:
    return f"{mean:+.3f} ± {half:.3f}" if np.isfinite(half) else f"{mean:+.3f} (1 seed)"


def report(runs: dict, base: dict) -> tuple[list[dict], str]:
    b = base["table"]["overall"]
    rows = []
    lines = [f"Base: strict {b['strict']:.3f}, score {b['score']:.3f} ({b['n']} eval images).", "",
             "| entry | seeds | budget s | iterations | strict gain (95% CI) | score gain (95% CI) | strict gain over null (95% CI) |",
             "|---|---|---|---|---|---|---|"]
    for name in sorted(runs):
        rs = runs[name]
        gains = {m: [r["evals"][-1]["table"]["overall"][m] - b[m] for r in rs] for m in ("strict", "score")}
        row = {"entry": name, "seeds": [r["seed"] for r in rs], "budget_s": rs[0]["budget_s"],
               "iterations": [r["step"] for r in rs], **{f"{m}_gain": interval(g) for m, g in gains.items()},
               **{f"{m}_final": [r["evals"][-1]["table"]["overall"][m] for r in rs] for m in ("strict", "score")}}
        null = runs.get(name + "_null")
        if null:
            row["strict_over_null"] = welch(row["strict_final"], [r["evals"][-1]["table"]["overall"]["strict"] for r in null])
        rows.append(row)
        lines.append(f"| {name} | {len(rs)} | {row['budget_s']:.0f} | {np.mean(row['iterations']):.0f} | {_fmt(*row['strict_gain'])} | "
                     f"{_fmt(*row['score_gain'])} | {_fmt(*row['strict_over_null']) if null else '-'} |")
    return rows, "\n".join(lines)


def plot(runs: dict, base: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    b = base["table"]["overall"]["strict"]
    for name in sorted(runs):
        curves = [[(0.0, b)] + [(e["wall_s"] - r["first_iteration_s"], e["table"]["overall"]["strict"]) for e in r["evals"] if e["step"] > 0]
                  for r in runs[name]]
        n = min(len(c) for c in curves)
        walls = np.mean([[w for w, _ in c[:n]] for c in curves], 0)
        ys = np.array([[y for _, y in c[:n]] for c in curves])
        line, = ax.plot(walls, ys.mean(0), marker="o", label=f"{name} ({len(curves)} seeds)", ls="--" if name.endswith("_null") else "-")
        if len(curves) > 1:
            ax.fill_between(walls, ys.min(0), ys.max(0), color=line.get_color(), alpha=0.15)
    ax.axhline(b, color="k", lw=1, label="base")
    ax.set_xlabel("training wall-clock after the first (compiling) iteration (s)")
    ax.set_ylabel("eval overall strict (mean over seeds; band min..max)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="", help=f"comma-separated entries of {sorted(ENTRIES)}")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--budget_s", type=float, default=300.0)
    parser.add_argument("--eval_every", type=int, default=0, help="iterations between evals (0: only before and at the end)")
    parser.add_argument("--per_category", type=int, default=0, help="test prompts per category (0: all 420)")
    parser.add_argument("--samples_per_prompt", type=int, default=2)
    parser.add_argument("--eval_cfg", type=float, default=3.0, help="every run's eval CFG, the base's too (one eval for all)")
    parser.add_argument("--workdir", default="/tmp/compare_methods")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "compare"))
    parser.add_argument("--rerun", action="store_true", help="run again the (entry, seed) pairs that already have a JSON")
    parser.add_argument("--report", action="store_true", help="only aggregate the runs already under --out")
    parser.add_argument("--set", action="append", default=[], help="a config override key=value (Python literal) for every "
                        "entry, repeatable (e.g. toy shapes to try a script); recorded in the runs' settings")
    args = parser.parse_args()
    from flowrl_jax import config_lib

    args.overrides = config_lib.parse_overrides(args.set)
    owned = [k for k in args.overrides if k in ("seed", "train.iterations", "train.time_budget_s") or k.startswith("eval.")]
    if owned:
        raise SystemExit(f"--set {', '.join(owned)}: set by this script (--seeds, --budget_s, --per_category, ...), not by --set")
    unknown = [n for n in args.methods.split(",") if n and n not in ENTRIES]
    if unknown:
        raise SystemExit(f"unknown entries {unknown}; known: {sorted(ENTRIES)}")

    base = base_eval(args)
    if not args.report:
        for name in filter(None, args.methods.split(",")):
            for seed in map(int, args.seeds.split(",")):
                trial = f"_{hashlib.sha1(json.dumps(args.overrides, sort_keys=True).encode()).hexdigest()[:8]}" if args.overrides else ""
                path = os.path.join(args.out, "runs", name, f"seed_{seed}{trial}.json")  # a --set trial never takes a real run's file
                if os.path.exists(path) and not args.rerun:
                    print(f"{name} seed {seed}: kept {path}")
                    continue
                result = run_one(name, seed, args)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w") as f:
                    json.dump(result, f, indent=1)
                final = result["evals"][-1]["table"]["overall"]
                print(f"{name} seed {seed}: {result['step']} iterations, strict {final['strict']:.3f}, score {final['score']:.3f}")
    runs = load_runs(args.out, eval_settings(args))
    if not runs:
        return
    rows, text = report(runs, base)
    print(text)
    with open(os.path.join(args.out, "compare_methods.md"), "w") as f:
        f.write(f"`python benchmarks/compare_methods.py --per_category {args.per_category} --samples_per_prompt "
                f"{args.samples_per_prompt} --out {os.path.relpath(args.out, ROOT)} --report`\n\n{text}\n")
    with open(os.path.join(args.out, "compare_methods.json"), "w") as f:
        json.dump({"settings": eval_settings(args), "base": base, "rows": rows}, f, indent=1)
    plot(runs, base, os.path.join(args.out, "compare_methods.png"))


if __name__ == "__main__":
    main()
