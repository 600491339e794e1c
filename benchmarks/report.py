"""Render every measured table in README.md and docs/*.md from its results file, so the figures cannot go stale.

    python benchmarks/report.py            # rewrite every <!-- report:NAME --> ... <!-- /report:NAME --> block in place
    python benchmarks/report.py --check    # list the stale blocks and exit 1; writes nothing

Each block in the docs sits between the markers `<!-- report:NAME -->` and `<!-- /report:NAME -->`; `REPORTS` maps
NAME to (its results file or folder, relative to the repository root; the function that renders it). A renderer gets
a `Source` (the loaded JSON, its path) and returns markdown: the table, then one line saying which file it came from,
the command that wrote it, the machine (as the file records it, or "not recorded") and the date (the file's own, else
the date of the last git commit that touched it, else "date not recorded"). Every number in a table comes from the
JSON. Only the standard library and numpy: no JAX, so the check takes well under a second.

Where git is unavailable (no git, not a repository, a shallow clone) the dates cannot be recomputed; `--check` then
compares the blocks with their date left out.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC_GLOBS = ("README.md", "docs/*.md")
BLOCK = re.compile(r"^<!-- report:(?P<name>[\w.-]+) -->(?P<body>.*?)^<!-- /report:(?P=name) -->", re.S | re.M)
DATE_FIELD = re.compile(r"date: [^\n]*")
GB, MIB = 1e9, 2**20


# ----------------------------------------------------------------------------------------------------------------------
# Sources: a results file (or folder) with its provenance

def _git(root: str, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_date(root: str, rel: str) -> str | None:
    """`git log -1 --format=%cs -- rel` in `root`: the date of the last commit that touched `rel`; today's where `rel`
    has changes not committed yet (a benchmark just rerun: the docs rendered now stay current once both are committed
    today); None where git cannot say (no git, not a repository, a shallow clone)."""
    if _git(root, "rev-parse", "--is-shallow-repository") != "false":
        return None
    if _git(root, "status", "--porcelain", "--", rel):
        return datetime.date.today().isoformat()
    return _git(root, "log", "-1", "--format=%cs", "--", rel) or None


def git_available(root: str) -> bool:
    return _git(root, "rev-parse", "--is-shallow-repository") == "false"


@dataclass
class Source:
    """A results file's JSON (a folder: {relative path: JSON} of every *.json under it) and where it lies."""
    rel: str
    root: str = ROOT
    data: object = field(init=False)

    def __post_init__(self):
        path = os.path.join(self.root, self.rel)
        if os.path.isdir(path):
            files = sorted(glob.glob(os.path.join(path, "**", "*.json"), recursive=True))
            self.data = {os.path.relpath(f, path): _load(f) for f in files}
        else:
            self.data = _load(path)

    def date(self, recorded: str | None = None) -> str:
        if recorded:
            return f"date: {recorded} (recorded in the file)"
        d = git_date(self.root, self.rel)
        return f"date: {d} (the last commit that touched it)" if d else "date: date not recorded"


def _load(path: str):
    with open(path) as f:
        return json.load(f)


def machine(env: dict | None = None, platforms=()) -> str:
    """What the file says about the machine: `env` (cpu, cpu_count, machine: `benchmarks/machine.py`, or the older
    machine, cpu_count) or `platform` strings; never more."""
    if env and env.get("cpu"):
        return f"machine: {env['cpu']}, {env.get('cpu_count', '?')} cores ({env.get('machine', '?')})"
    if env and (env.get("machine") or env.get("cpu_count")):
        parts = [env.get("machine", "architecture not recorded")]
        if env.get("cpu_count"):
            parts.append(f"{env['cpu_count']} cores (os.cpu_count())")
        return "machine: " + ", ".join(parts) + "; CPU model not recorded"
    platforms = sorted({p for p in platforms if p})
    if platforms:
        return "machine: " + " / ".join(f"`{p}`" for p in platforms) + " (platform string only: CPU model and cores not recorded)"
    return "machine not recorded"


def provenance(src: Source, command: str, where: str, recorded_date: str | None = None, how: str = "") -> str:
    """The line under a table: the results file, the command that wrote it (`how`: what follows the command), the
    machine and the date."""
    path = src.rel + ("/" if os.path.isdir(os.path.join(src.root, src.rel)) else "")
    return f"Source: `{path}`, written by `{command}`{how}; {where}; {src.date(recorded_date)}."


def command_from_args(script: str, args: dict, skip=("workdir", "out", "merge")) -> str:
    parts = [f"python {script}"]
    for k, v in args.items():
        if k in skip:
            continue
        v = f"{v:g}" if isinstance(v, float) else v
        parts.append(f"--{k} {v}")
    return " ".join(parts)


# ----------------------------------------------------------------------------------------------------------------------
# Number formats

def e1(x: float) -> str:
    """6.754e-09 -> '6.8e-9'."""
    m, e = f"{x:.1e}".split("e")
    return f"{m}e{int(e)}"


def n0(x: float) -> str:
    return f"{x:,.0f}"


def f1(x: float) -> str:
    return f"{x:.1f}"


def f2(x: float) -> str:
    return f"{x:.2f}"


def f3(x: float) -> str:
    return f"{x:.3f}"


def pct(x: float) -> str:
    """0.9437 -> '94.4%'."""
    return f"{100 * x:.1f}%"


def sig3(x: float) -> str:
    """Three significant digits, trailing zeros dropped: 0.014031 -> '0.014', 61.349 -> '61.3'."""
    if x == 0:
        return "0"
    digits = max(0, 2 - int(math.floor(math.log10(abs(x)))))
    s = f"{x:.{digits}f}"
    return s.rstrip("0").rstrip(".") if "." in s else s


def sig3k(x: float) -> str:
    """Three significant digits, trailing zeros kept: 5.4039 -> '5.40', 27.445 -> '27.4'."""
    digits = max(0, 2 - int(math.floor(math.log10(abs(x))))) if x else 0
    return f"{x:.{digits}f}"


def pm(mean: float, half: float) -> str:
    return f"{mean:+.3f} ± {half:.3f}"


def bold(s: str, on: bool = True) -> str:
    return f"**{s}**" if on else s


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


# Student t quantiles at 0.975 (two-sided 95%), by degrees of freedom: the distribution's constants, not measurements.
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def t_interval(values) -> tuple[float, float]:
    v = np.asarray(values, float)
    return float(v.mean()), float(T975[v.size - 1] * v.std(ddof=1) / np.sqrt(v.size))


# ----------------------------------------------------------------------------------------------------------------------
# The embedded world

def render_shapes_eval(src: Source) -> str:
    d = src.data
    timing = table(["image size", "pixel noise std", "s per batch of images", "images/s", "strict on own prompts"],
                   [[f"{r['size']}x{r['size']}", f"{r['noise']:g}", f"{r['seconds']:.3f} ({r['batch']:,})",
                     n0(r["images_per_s"]), f"{r['strict_mean']:.3f}"] for r in d["timing"]])
    cats = list(d["validation"])
    val = table(["category", "scenes", "accepts its own prompt (clean / noisy)", "rejects a near-miss (clean / noisy)"],
                [[c, f"{d['validation'][c]['n']:,}",
                  f"{100 * d['validation'][c]['accept']:.2f}% / {100 * d['validation_noise'][c]['accept']:.2f}%",
                  f"{100 * d['validation'][c]['reject']:.2f}% / {100 * d['validation_noise'][c]['reject']:.2f}%"]
                 for c in cats])
    note = f"Noisy: pixel noise of std {d['noise_std']:g} on the [-1, 1] scene, like a model's samples."
    return "\n\n".join([timing, val, note, provenance(src, "python benchmarks/shapes_eval.py", machine(d.get("env")))])


def render_shapes32(src: Source) -> str:
    d = src.data
    t, s = d["test_eval"], d["test_eval_settings"]
    rows = [[bold(c, c == "overall"), bold(f3(v["strict"]), c == "overall"), bold(f3(v["score"]), c == "overall")]
            for c, v in t.items()]
    note = (f"`{d['name']}` after {d['training_steps']:,} pretraining steps; test.jsonl x {s['samples_per_prompt']} samples "
            f"({t['overall']['n']} images), ODE {s['num_steps']} steps, CFG {s['cfg']:g}, shift {s['shift']:g}.")
    return "\n\n".join([table(["category", "strict", "score"], rows), note,
                        provenance(src, "python -m flowrl_jax.main --config configs/export_shapes32.py", machine())])


# ----------------------------------------------------------------------------------------------------------------------
# Results of the methods

QUICKSTART_HELD_OUT = (3, 4)  # seeds run after the 60 iterations were chosen on seeds 0-2 (results/quickstart/README.md)


def render_quickstart(src: Source) -> str:
    runs = sorted((int(re.search(r"(\d+)", k).group(1)), v) for k, v in src.data.items() if k.startswith("eval_seed"))
    cats = [c for c in runs[0][1]["evals"][0]["table"] if c != "overall"]
    rows, gains = [], {"strict": [], "score": []}
    for seed, r in runs:
        before, after = r["evals"][0]["table"], r["evals"][-1]["table"]
        g = {m: after["overall"][m] - before["overall"][m] for m in gains}
        for m in gains:
            gains[m].append(g[m])
        label = f"{seed} (held out)" if seed in QUICKSTART_HELD_OUT else str(seed)
        rows.append([label, f"{f3(before['overall']['strict'])} -> {f3(after['overall']['strict'])}", bold(f"{g['strict']:+.3f}"),
                     f"{f3(before['overall']['score'])} -> {f3(after['overall']['score'])}"]
                    + [f"{f3(before[c]['strict'])} -> {f3(after[c]['strict'])}" for c in cats])
    header = ["seed", "overall strict before -> after", "gain", "score before -> after"] + cats
    steps = sorted({r["evals"][-1]["step"] for _, r in runs})
    lines = []
    for m in gains:
        mean, half = t_interval(gains[m])
        lines.append(f"{m} {mean:+.3f} (95% t-interval {mean - half:+.3f} to {mean + half:+.3f})")
    n_eval = runs[0][1]["evals"][0]["table"]["overall"]["n"]
    summary = (f"Mean gain over the {len(runs)} seeds: " + ", ".join(lines) + f". Tables after {'/'.join(map(str, steps))} "
               f"iterations, {n_eval} eval images each; category columns are strict accuracy.")
    return "\n\n".join([table(header, rows), summary,
                        provenance(src, "python -m flowrl_jax.main --config configs/quickstart.py --workdir /tmp/q "
                                   "--config.seed=<seed>", machine())])


COMPARE_ORDER = ("flow_grpo", "flow_grpo_null", "flow_grpo_fast", "flow_grpo_fast_null", "spatial", "stepwise", "tp_grpo",
                 "lambda_grpo", "adagrpo", "lc_grpo", "advantage_flow", "nft", "leapalign")
COMPARE_NOTES = {"flow_grpo": "after issue 45", "flow_grpo_null": "after issue 45", "nft": "after issue 45",  # rerun; the
                 "flow_grpo_fast": "seeds 3-5 after issue 45", "flow_grpo_fast_null": "seeds 3-5 after issue 45"}  # rest before


def render_compare(src: Source) -> str:
    d = src.data["compare_methods.json"]
    runs = [v for k, v in src.data.items() if k.startswith("runs" + os.sep)]
    rows = sorted(d["rows"], key=lambda r: (COMPARE_ORDER.index(r["entry"]) if r["entry"] in COMPARE_ORDER else 99, r["entry"]))
    budgets = [r["budget_s"] for r in rows]
    usual = max(set(budgets), key=budgets.count)
    out = []
    for r in rows:
        notes = ([f"{r['budget_s']:g} s"] if r["budget_s"] != usual else []) + ([COMPARE_NOTES[r["entry"]]] if r["entry"] in COMPARE_NOTES else [])
        label = r["entry"] + (f" ({'; '.join(notes)})" if notes else "")
        cells = [bold(pm(*r[k]), abs(r[k][0]) > r[k][1]) for k in ("strict_gain", "score_gain")]
        if "strict_over_null" in r:
            null = bold(pm(*r["strict_over_null"]), abs(r["strict_over_null"][0]) > r["strict_over_null"][1])
        else:
            null = "-" if r["entry"].endswith("_null") else "(no null run)"
        out.append([label, len(r["seeds"]), f"{np.mean(r['iterations']):.0f}", *cells, null])
    b = d["base"]["table"]["overall"]
    head = (f"Base: strict {f3(b['strict'])}, score {f3(b['score'])} on {b['n']} eval images "
            f"({d['settings']['samples_per_prompt']} samples per test prompt). Bold: the 95% interval is clear of zero.")
    dates = sorted(r["date"][:10] for r in runs if r.get("date"))
    recorded = f"{dates[0]} to {dates[-1]}, per run" if dates else None
    budgets_txt = ", ".join(f"{b:g}" for b in sorted(set(budgets)))
    command = "python benchmarks/compare_methods.py --methods <entries> --seeds 0,1,2 --budget_s <s>"
    how = f" per entry (budgets {budgets_txt} s), then `python benchmarks/compare_methods.py --report`"
    return "\n\n".join([head, table(["entry", "seeds", "iterations (mean)", "strict gain over base (95% CI)", "score gain (95% CI)",
                                      "strict gain over the null control (95% CI)"], out),
                        provenance(src, command, machine(platforms=[r.get("platform") for r in runs]), recorded, how)])


def _one_seed(src: Source, notes: dict) -> str:
    """compare_methods.py's earlier, one-seed format: each method's evals at an equal step count and at the budget."""
    d = src.data
    base = d["base"]["table"]["overall"]
    steps = sorted({r["equal_steps"] for r in d["rows"]})
    budget = d["args"]["budget_s"]
    columns = ("strict_at_steps", "strict_at_budget", "score_at_budget", "learned_reward_at_budget")
    shown = {c: [f3(r[c]) for r in d["rows"]] for c in columns}
    best = {c: max(v, key=float) for c, v in shown.items()}
    best = {c: b if shown[c].count(b) == 1 else None for c, b in best.items()}  # a tie has no best
    rows = [["base model", 0, "-", f3(base["strict"]), f3(base["strict"]), f3(base["score"]), f3(d["base"]["learned_reward"])]]
    for r in d["rows"]:
        label = r["method"] + (f" ({notes[r['method']]})" if r["method"] in notes else "")
        moved = r["strict_at_budget"] - base["strict"] > 0.03  # beyond one 210-prompt eval's noise (about ±0.03)
        rows.append([bold(label, moved), r["iterations"], f1(r["s_per_iteration"])]
                    + [bold(f3(r[c]), f3(r[c]) == best[c]) for c in columns])
    header = ["method", "iterations", "s / it", f"strict @ {'/'.join(map(str, steps))} it", f"strict @ {budget:g} s",
              f"score @ {budget:g} s", f"learned reward @ {budget:g} s"]
    note = (f"One seed (`--seed {d['args']['seed']}`), {base['n']} eval images. Bold method: strict gain at the budget "
            "beyond ±0.03; bold figure: the column's best.")
    return "\n\n".join([table(header, rows), note,
                        provenance(src, command_from_args("benchmarks/compare_methods.py", d["args"]),
                                   machine(platforms=[d.get("platform")]))])


def render_compare_one_seed(src: Source) -> str:
    return _one_seed(src, {})


def render_compare_issue20(src: Source) -> str:
    return _one_seed(src, {"spatial": "per-step maps", "tp_grpo": "single-sign bonus kept", "nft": "NVlabs' recipe, CFG-free",
                           "leapalign": "gamma on the model's input"})


GRADIENT_SNR_LABELS = {  # (config, overrides) -> the design's name
    ("configs/flow_grpo_fast.py", "{}"): "Flow-GRPO-Fast, No-CFG (`flow_grpo_fast.py`)",
    ("configs/flow_grpo_cpu.py", "{}"): "Flow-GRPO, window (0, 2) (`flow_grpo_cpu.py`)",
    ("configs/mixgrpo.py:flash", "{}"): "MixGRPO-Flash (`mixgrpo.py:flash`)",
    ("configs/mixgrpo.py", "{}"): "MixGRPO (`mixgrpo.py`)",
    ("configs/grpo_guard.py", "{}"): "GRPO-Guard (`grpo_guard.py`)",
    ("configs/flow_grpo_cpu.py", '{"sampler.same_noise_per_group": false, "sampler.sde_window": [0, 9]}'):
        "Flow-GRPO, window (0, 9), own noise",
}


def render_gradient_snr(src: Source) -> str:
    judged = [r for r in src.data if "seconds_for_snr_1_at_least" in r and not r.get("null")]
    judged.sort(key=lambda r: r["seconds_for_snr_1_at_least"])
    rows = []
    for r in judged:
        key = (r["config"], json.dumps(r["overrides"], sort_keys=True))
        lo, hi = r["mu2_ci95"]
        clear = lo > 0  # the interval excludes zero: signal at this many groups
        groups = f"{n0(r['groups_for_snr_1'])} / {n0(r['groups_for_snr_1_at_least'])}"
        rows.append([bold(GRADIENT_SNR_LABELS.get(key, f"`{r['config']}` {r['overrides']}"), clear), r["trained_steps"],
                     bold(f"{e1(r['mu2'])} ({e1(lo)} .. {e1(hi)})", clear), e1(r["trace_sigma"]),
                     bold(groups, clear) + (f" (at most {n0(r['trace_sigma'] / lo)})" if clear else ""),
                     f"{r['transfer_cosine']:.3f} ± {r['transfer_cosine_se']:.3f}",
                     f"{f2(r['rollout_s_per_group'])} + {f2(r['gradient_s_per_group'])}",
                     bold(f"{n0(r['seconds_for_snr_1'])} / {n0(r['seconds_for_snr_1_at_least'])}", clear)])
    header = ["design", "trained steps", "`\\|\\|mu\\|\\|^2` (95% interval)", "tr Sigma", "groups for SNR 1 (point / at least)",
              "transfer cosine", "s per group (rollout + gradient)", "s to SNR 1 (point / at least)"]
    groups = sorted({r["groups"] for r in judged})
    sizes = sorted({r["group_size"] for r in judged})
    note = (f"{'/'.join(map(str, groups))} groups of {'/'.join(map(str, sizes))} images per design, seed "
            f"{'/'.join(sorted({str(r['seed']) for r in judged}))}; bold: the interval of `||mu||^2` excludes zero.")
    return "\n\n".join([table(header, rows), note,
                        provenance(src, "bash benchmarks/snr_judge.sh", machine(platforms=[r.get("platform") for r in judged]),
                                   how=f" (`python benchmarks/gradient_snr.py --config <config> --groups {groups[-1]}` per design)")])


def render_lambda_budget(src: Source) -> str:
    d = src.data
    names = {"flow_grpo": "Flow-GRPO", "grpo_guard": "GRPO-Guard", "lambda_grpo": "lambda-GRPO"}
    curves = d["curves"]
    order = [k for k in names if k in curves] + [k for k in curves if k not in names]
    last = curves[order[0]]["steps"][-1]
    first = curves[order[0]]["steps"][:2]
    rows = [
        [f"step {last} (last): mean V_t / budget"] + [f"{c['last_step_over_budget'][0]:.2f} ± {c['last_step_over_budget'][1]:.2f}"
                                                      for c in (curves[k] for k in order)],
        [f"step {last}: mean V_t (max)"] + [f"{e1(c['mean'][-1])} ({e1(c['max'][-1])})" for c in (curves[k] for k in order)],
        [f"steps {first[0]}-{first[-1]}: mean V_t"] + [", ".join(e1(v) for v in c["mean"][:2]) for c in (curves[k] for k in order)],
        ["(iteration, step) cells over the budget"] + [f"{100 * c['over_budget_cells'][0]:.0f}% ± {100 * c['over_budget_cells'][1]:.0f}%"
                                                       for c in (curves[k] for k in order)],
    ]
    for m in ("strict", "score") if all("eval_strict" in c for c in curves.values()) else ():
        gain = lambda c: f" ({c[f'eval_{m}_gain'][0]:+.3f} ± {c[f'eval_{m}_gain'][1]:.3f})" if f"eval_{m}_gain" in c else ""  # noqa: E731
        rows.append([f"final eval {m} (gain over the base)"] + [f"{f3(c[f'eval_{m}'][0])} ± {f3(c[f'eval_{m}'][1])}{gain(c)}"
                                                              for c in (curves[k] for k in order)])
    seeds = d["args"]["seeds"].split(",")
    note = (f"Budget `eps^2 D` = {e1(d['budget'])} (lambda-GRPO's); {d['args']['iterations']} iterations, "
            f"{len(seeds)} seeds, mean over seeds with a 95% t-interval.")
    if d.get("base_eval"):
        note += (f" Final eval: compare_methods.py's ({d['base_eval']['n']} images: all test prompts x 2, CFG 3, the same "
                 f"prompts and noise), base strict {f3(d['base_eval']['strict'])}, score {f3(d['base_eval']['score'])}.")
    a = d["args"]
    extra = "".join(f" --{k} {a[k]}" for k in ("shift", "beta", "clip_range", "tag") if a.get(k) not in (None, ""))
    extra += " --eval" if a.get("eval") else ""
    command = f"python benchmarks/lambda_budget.py --iterations {a['iterations']} --seeds {a['seeds']}{extra}"
    return "\n\n".join([table([""] + [names.get(k, k) for k in order], rows), note, provenance(src, command, machine())])


def render_sampler_gap(src: Source) -> str:
    d = src.data
    rows = [[r["kernel"], r["window"], f3(r["score"]), f3(r["strict"]), f"{r['gap_score']:+.3f}", f"{r['gap_strict']:+.3f}"]
            for r in d["rows"]]
    a = d["args"]
    note = (f"{d['images']} images: up to {a['per_category']} train prompts per category x {a['group']}, base `{a['base']}`, "
            f"SDE noise level {a['noise_level']:g}; gap = kernel minus ODE (negative: the training rollouts are worse samples).")
    return "\n\n".join([table(["kernel", "SDE on", "score", "strict", "score gap", "strict gap"], rows), note,
                        provenance(src, command_from_args("benchmarks/sampler_gap.py", a), machine(platforms=[d.get("platform")]))])


# ----------------------------------------------------------------------------------------------------------------------
# Performance

def render_compare_torch(src: Source) -> str:
    d = src.data
    sides = ("flowrl_jax", "torch_eager", "torch_compile")
    peak = d["matmul_peak"]["jax_gflop_s"]
    rows = []
    for r in d["results"]:
        s = {k: r["sides"][k] for k in sides if k in r["sides"]}
        ours = s["flowrl_jax"]["iteration_s"]
        label = {"quickstart": f"CPU budget, Flow-GRPO (shapes32, {r['batch']} images, {r['num_steps']} steps)",
                 "medium": f"medium (width 512, depth 12, 256 tokens, {r['batch']} images, {r['num_steps']} steps)"}.get(r["setup"], r["setup"])
        times = [f"{sig3k(ours)} s"] + [f"{sig3k(s[k]['iteration_s'])} s ({bold(f2(s[k]['iteration_s'] / ours) + 'x')})" if k in s else "-"
                                     for k in sides[1:]]
        rate = (lambda x: f1(x) if x >= 10 else f2(x))
        rows.append([label, *times, " / ".join(rate(s[k]["rollout_images_per_s"]) for k in s),
                     " / ".join(rate(s[k]["update_pairs_per_s"]) for k in s),
                     f"{100 * s['flowrl_jax']['update_gflop_s'] / peak:.0f}%"])
    rounds = len(d["results"][0]["sides"]["flowrl_jax"]["all"]) - 1
    e = d["env"]
    note = (f"x = torch time / ours; medians of rounds 1-{rounds} (round 0 compiles). "
            f"{'bf16' if e.get('bf16') else 'float32'}, torch on {e.get('torch_device', 'cpu')}; jax {e['jax']}, torch {e['torch']}; "
            f"matmul peak {peak:.0f} GFLOP/s for jax and {d['matmul_peak']['torch_gflop_s']:.0f} for torch.")
    header = ["setup", "flowrl_jax", "torch eager", "torch.compile", "rollout img/s (ours / eager / compiled)",
              "update pairs/s (ours / eager / compiled)", "our update, % of peak"]
    return "\n\n".join([table(header, rows), note, provenance(src, "python benchmarks/compare_torch.py --repeats 3", machine(e))])


def render_profile_step(src: Source) -> str:
    d = src.data
    it = d["iteration"][-1]
    walls = {"jit_rollout_fn": ("rollout", it["rollout_s"]), "jit_update": (f"update ({it['updates']} optimizer steps)", it["update_s"])}
    rows = []
    for prog, (label, wall) in walls.items():
        p = d["programs"][prog]
        top = list(p["ops"].items())[:3]
        rows.append([f"{label} (`{prog}`)", f2(wall), f2(p["total_ms"] / 1e3),
                     ", ".join(f"`{k}` {100 * v / p['total_ms']:.1f}%" for k, v in top)])
    note = ("Op time: the trace's XLA events summed per program; events on several threads add up, and XLA:CPU's dot "
            "events appear to end at dispatch, so matmuls are undercounted.")
    return "\n\n".join([table(["program", "wall s", "XLA op time, s", "largest op kinds (share of the op time)"], rows), note,
                        provenance(src, f"python benchmarks/profile_step.py --setup {d['setup']}", machine())])


COMPILE_LABELS = {"sd35m_v6e8": "SD3.5-M {p}, v6e-8 plan (remat)", "sd35m_v6e8_noremat": "SD3.5-M {p}, no remat",
                  "quickstart": "quickstart {p}"}


def render_compile_time(src: Source) -> str:
    d = src.data
    res = d["results"]
    setups = list(dict.fromkeys(k.split("/")[0] for k in res))

    def secs(part):  # lower + compile for the SD3.5-M programs; first call minus a warm one for the quickstart
        return part["compile_s"] + part.get("lower_s", 0.0)

    rows = []
    for s in setups:
        for p in ("rollout", "update"):
            b = [secs(res[f"{s}/before"][m][p]) for m in ("cold", "cache")]
            a = [secs(res[f"{s}/after"][m][p]) for m in ("cold", "cache")]
            rows.append([COMPILE_LABELS.get(s, s + " {p}").format(p=p), f1(b[0]), f1(b[1]),
                         bold(f1(a[0]), a[0] <= b[0] / 2), bold(f1(a[1]), a[1] <= b[1] / 2)])
    whole = "; ".join(f"{s} {res[f'{s}/before']['cold']['process_s']:.0f} -> {res[f'{s}/after']['cold']['process_s']:.0f} s, "
                      f"{res[f'{s}/after']['cache']['process_s']:.0f} s cached" for s in setups)
    note = (f"Seconds. Bold: at most half of before. Whole start (the process, building the abstract weights included), "
            f"before -> after: {whole}.")
    return "\n\n".join([table(["program", "before, cold", "before, cached", "after, cold", "after, cached"], rows), note,
                        provenance(src, f"python benchmarks/compile_time.py --before {d['before']}", machine(d.get("env")))])


def render_rl_step(src: Source) -> str:
    d = src.data
    rows = [[f"`{r['config']}`" + (f" {r['overrides']}" if r.get("overrides") else ""), r["batch"],
             f"{r['num_steps']} ({r['trained_steps']})", f"{f2(r['rollout_s'])} ({f1(r['rollout_images_per_s'])})",
             f"{r['reward_s']:.3f}", f"{f2(r['update_s'])} ({f1(r['update_pairs_per_s'])})", f2(r["iteration_s"])] for r in d["rows"]]
    header = ["config (as it was then)", "images", "steps (trained)", "rollout s (images/s)", "reward s",
              "update s (pairs/s)", "iteration s"]
    return "\n\n".join([table(header, rows), provenance(src, "python benchmarks/rl_step.py --config configs/quickstart.py",
                                                         machine(d.get("env")))])


def render_dit_forward(src: Source) -> str:
    d = src.data
    rows = [[r["preset"], f"{r['params'] / 1e6:.2f}M", r["batch"], r["tokens"], r["text_len"], f2(r["forward_ms"]),
             f1(r["forward_gflop_s"]), f1(r["fwd_bwd_ms"]) if r["fwd_bwd_ms"] >= 10 else f2(r["fwd_bwd_ms"]),
             f1(r["fwd_bwd_gflop_s"]), f"{sig3(r['forward_gflops'])} / {sig3(r['xla_forward_gflops'])}"] for r in d["rows"]]
    header = ["preset", "params", "batch", "image tokens", "text tokens", "forward ms", "forward GFLOP/s", "fwd+bwd ms",
              "fwd+bwd GFLOP/s", "GFLOP per forward (hand / XLA)"]
    return "\n\n".join([table(header, rows), provenance(src, "python benchmarks/dit_forward.py", machine(d.get("env")))])


def render_leapalign_memory(src: Source) -> str:
    d = src.data
    rows = [[r["steps"], f1(r["leapalign"] / MIB), f1(r["full_backprop"] / MIB), f1(r["full_backprop_checkpoint"] / MIB)]
            for r in d["rows"]]
    first, last = d["rows"][0], d["rows"][-1]
    slope = (last["full_backprop"] - first["full_backprop"]) / (last["steps"] - first["steps"]) / MIB
    a = d["args"]
    note = (f"XLA's temp buffers (MiB) of one reward-gradient update, `{a['preset']}`, batch {a['batch']}. "
            f"Full backprop grows {slope:.0f} MiB per step; LeapAlign stays flat.")
    return "\n\n".join([table(["sampler steps T", "LeapAlign", "full backprop", "full backprop + checkpoint"], rows), note,
                        provenance(src, command_from_args("benchmarks/memory.py", a), machine(platforms=[d.get("platform")]))])


def render_throughput_on_paper(src: Source) -> str:
    d = src.data
    per = d["per_image_TFLOP"]
    parts = table(["per image, TFLOP", *per.keys()], [["", *(f1(v) for v in per.values())]])
    rows = [[name, f1(s["peak_PFLOPs"]), f"{s['images_per_hour'] / 1e3:.0f}k", f"{s['s_per_1152']:.0f}"] for name, s in d["slices"].items()]
    note = (f"MMDiT forward {n0(d['mmdit_forward_GFLOP']['hand'])} GFLOP by our hand count, "
            f"{n0(d['mmdit_forward_GFLOP']['xla'])} by XLA's; VAE decode {n0(d['vae_decode_GFLOP'])} GFLOP. "
            f"Images per hour at {100 * d['mfu']:.0f}% of the bf16 peak: estimates, not measurements.")
    return "\n\n".join([parts, table(["slice", "bf16 peak, PFLOP/s", "images / h", "s per flow_grpo epoch of 1,152 images"], rows),
                        note, provenance(src, f"python benchmarks/throughput_on_paper.py --mfu {d['mfu']:g}",
                                         "machine not recorded (abstract shapes: counts, not timings)")])


# ----------------------------------------------------------------------------------------------------------------------
# Real models, rewards

def render_text_cache(src: Source) -> str:
    d = src.data
    rows = [[k, n0(v["params"]), f2(v["bf16_GB"]), f1(v["GFLOP_per_prompt"])] for k, v in d["encoders"].items()]
    note = (f"Encoders on the fly: {f2(d['encoders_bf16_GB'])} GB of bf16 weights, {n0(d['encode_GFLOP_per_prompt'])} GFLOP per "
            f"encoded row (T5 at {d['t5_tokens']} tokens). The cache: {f2(d['cache_MB_per_prompt'])} MB per prompt, "
            f"the encoders' memory at {d['break_even_prompts']:,} prompts.")
    return "\n\n".join([table(["encoder", "parameters", "bf16 GB", "GFLOP per prompt"], rows), note,
                        provenance(src, f"python benchmarks/text_cache.py --t5_tokens {d['t5_tokens']}",
                                   "machine not recorded (abstract shapes: counts, not timings)")])


def render_reward_throughput(src: Source) -> str:
    d = src.data
    rows = [[f"`{k}`", v["tower"], f"{f1(v['gflop_hand'])} / {f1(v['gflop_xla'])}", f"{100 * v['share_grpo']:.2f}%",
             f"{100 * v['share_gradient_methods']:.2f}%"] for k, v in d["rewards"].items()]
    tiny = d["tiny_images_per_s"]
    note = (f"Share: of an SD3.5-M Flow-GRPO iteration's {d['iteration_tflop_per_image']:g} TFLOP per image; the gradient "
            f"methods run the reward forward and backward. Tiny towers on `{d['device']}`: {n0(tiny['forward'])} images/s "
            f"forward, {n0(tiny['grad'])} with the gradient (a check that the path is jitted, not a forecast).")
    return "\n\n".join([table(["reward", "tower", "GFLOP per image, by hand / XLA", "share (Flow-GRPO)",
                               "share (gradient methods)"], rows), note,
                        provenance(src, "python benchmarks/reward_throughput.py", machine())])


def render_reward_service(src: Source) -> str:
    d = src.data
    rows = []
    for o in d["overlap"]:
        for mode in ("sequential", "overlapped"):
            m = o[mode]
            rows.append([f"{o['delay_s_per_batch']:g}", mode, f2(m["rollout_s"] + m["reward_s"]), f2(m["update_s"]),
                         f2(m["iteration_s"]), "1" if mode == "sequential" else f"{o['speedup']:.2f}x"])
    per = sorted({o["batches_per_iteration"] for o in d["overlap"]})
    timed = sorted({o[m]["iterations_timed"] for o in d["overlap"] for m in ("sequential", "overlapped")})
    ld = d["load"]
    note = (f"Means of {'/'.join(map(str, timed))} iterations after the first. Load: {ld['clients']} clients, {ld['requests']:,} "
            f"requests of {ld['images_per_request']} images in all: p50 {f1(ld['p50_ms'])} ms, p99 {f1(ld['p99_ms'])} ms, "
            f"{ld['requests_per_s']:.0f} requests/s.")
    return "\n\n".join([table([f"server s per batch ({'/'.join(map(str, per))} per iteration)", "scoring", "rollout + reward s",
                               "update s", "iteration s", "speedup"], rows), note,
                        provenance(src, "python benchmarks/reward_service.py", machine())])


def render_reward_attacks(src: Source) -> str:
    d, c = src.data, src.data["caps"]
    rows = [[f"`{name}`", " ".join(a["doc"].split()), ", ".join(f"{n} x {'closed' if int(k) == 0 else 'open' if int(k) == 1 else k}"
                                              for k, n in a["statuses"].items()),
             f"{a['peak_mib']:.0f}", f"{a['health_p99_ms']:.0f} / {a['health_max_ms']:.0f}"
             + (f" ({a['health_failed']} of {a['health_polls']} failed)" if a["health_failed"] else ""),
             f"{a['honest_p50_ms']:.0f} / {a['honest_p99_ms']:.0f}"] for name, a in d["attacks"].items()]
    note = (f"Caps: the server's defaults (`--max_pending {c['max_pending']}`, `--max_body_mb {c['max_body_bytes'] / 2 ** 20:g}`, "
            f"`--max_pixels {c['max_pixels']}`, `--max_batch {c['max_batch']}`, `--max_connections {c['max_connections']}`) but "
            f"`--body_timeout_s {c['body_timeout_s']:g}` and `--delay_s {c['delay_s']:g}`, serving `{d['reward']}`. Bound past the "
            f"idle server ({d['idle_mib']:.0f} MiB): {d['bound_mib']:.0f} MiB, plus the reward's own on one batch "
            f"(`{d['reward']}`: 28 bytes a pixel, {28 * c['max_pixels'] / 2 ** 20:.0f} MiB). Peak: VmHWM past idle during the "
            "attack. /health: GET on a fresh connection every 20 ms from its own process. Honest: two threads of our client "
            "scoring 4 images of 32 x 32 in a loop, retries included. One run, attacker and server on the same machine, the "
            f"server at nice {d.get('server_nice', 0)} so the attacker does not take its cores (at equal priority on this 2-core "
            "machine /health's worst poll was 413 ms during the held uploads and 253 ms during the legal batches, one run each).")
    return "\n\n".join([table(["attack", "what it does", "answers", "peak MiB", "/health p99 / max ms", "honest p50 / p99 ms"], rows),
                        note, provenance(src, "python benchmarks/reward_attacks.py", machine(d.get("env")))])


# ----------------------------------------------------------------------------------------------------------------------
# Scale-out

def _mesh(plan: dict) -> tuple[int, int]:
    """(data, fsdp): the plan's mesh, else configs' default, FSDP over every device."""
    mesh = dict(plan.get("mesh", [("data", 1), ("fsdp", plan["devices"])]))
    return mesh["data"], mesh["fsdp"]


def _largest(p: dict) -> str:
    return ", ".join(bold(n0(v)) + f" ({k} GB)" if v else f"does not fit ({k} GB)" for k, v in p["largest_prompts"].items())


def render_memory_plan(src: Source, command: str = "python benchmarks/memory_plan.py") -> str:
    rows = []
    for name, p in src.data.items():
        if p.get("method", "grpo") != "grpo":
            continue
        plan, nb, lo = p["plan"], p["native_bf16"], p["low"]
        data, fsdp = _mesh(plan)
        frozen = "(one device)" if plan["devices"] == 1 else ("replicated" if plan.get("frozen_dit") == "replicate" else "FSDP")
        dtype = "bf16" if plan.get("param_dtype") == "bfloat16" else "f32"
        memory = f"{plan['memory_gb']} GB" + "".join(f" ({g} GB)" for g in plan.get("also_gb", ()))
        ph = nb["phases"]
        rows.append([name, f"{plan['devices']} x {memory}", f"{data} x {fsdp}",
                     f"{plan['rollout_chunk']} / {plan['microbatch']}, {dtype}, {frozen}", f1(nb["live"] / GB), f1(nb["stored"] / GB),
                     f1(ph["rollout"]["peak"] / GB), f1(ph["decode"]["peak"] / GB), f1(ph["update"]["peak"] / GB),
                     f1(ph["eval"]["peak"] / GB) if "eval" in ph else "not measured",
                     f"{bold(f1(nb['peak'] / GB))} ({f1(lo['peak'] / GB)})", f1(p["hand"]["peak"] / GB), _largest(p)])
    any_plan = next(iter(src.data.values()))["low"]
    group = any_plan["batch"] // any_plan["prompts"]
    header = ["plan", "devices x memory", "mesh (data x fsdp)", "knobs: chunk / microbatch (global), weights, frozen DiT",
              "weights + state", "stored rollout", "rollout", "decode", "update", "eval", "peak: bound (XLA:CPU)", "hand",
              f"largest prompts x {group}"]
    note = (f"GB per device at {any_plan['prompts']} prompts x {group} images; the eval: one batch of the preset's "
            "`eval.batch_size` rows (sampled and decoded, sharded over every device) beside the merged DiT.")
    return "\n\n".join([table(header, rows), note, provenance(src, command, machine())])


def render_memory_plan_leapalign(src: Source, command: str = "python benchmarks/memory_plan.py --method leapalign") -> str:
    rows = []
    for name, p in src.data.items():
        if p.get("method") != "leapalign":
            continue
        nb, lo = p["native_bf16"], p["low"]
        ph = nb["phases"]
        rows.append([name.split("+")[0], f1(nb["live"] / GB), f1(ph["rollout"]["peak"] / GB), f1(ph["decode"]["peak"] / GB),
                     f1(ph["update"]["peak"] / GB), f"{bold(f1(nb['peak'] / GB))} ({f1(lo['peak'] / GB)})", _largest(p)])
    group = next(iter(src.data.values()))["low"]
    header = ["plan", "weights + state", "rollout", "decode", "update", "peak: bound (XLA:CPU)",
              f"largest prompts x {group['batch'] // group['prompts']}"]
    return "\n\n".join([table(header, rows), provenance(src, command, machine())])


def render_methods_on_flux(src: Source) -> str:
    rows = []
    for name, r in src.data["methods"].items():
        result = f"ran: loss {r['loss']:.3g}, reward {r['reward']:.3g}" if r["ran"] else f"failed: {r['error']}"
        rows.append([f"`configs/{name}.py`", r.get("objective", ""), ", ".join(r.get("credit", ())), r.get("kernel", ""), result])
    header = ["method config", "objective", "credit", "kernel", "one iteration on the tiny FLUX pipeline"]
    return "\n\n".join([table(header, rows), provenance(src, "python benchmarks/methods_on_flux.py", machine(src.data.get("env")))])


def render_frozen_dit_traffic(src: Source) -> str:
    rows = []
    for name, p in src.data.items():
        if p["fsdp"] == 1:
            continue  # one device per replica: nothing to all-gather
        rows.append([name, p["fsdp"], "bf16" if p["dtype"] == "bfloat16" else "f32",
                     f"{f2(p['per_device']['replicate'] / GB)} / {f2(p['per_device']['fsdp'] / GB)}",
                     n0(p["calls"]["rollout"] + p["calls"]["update"]), f"{f1(p['gathered_per_iteration']['fsdp'] / 1e12)} TB",
                     "replicated" if p["chosen"] == "replicate" else "FSDP"])
    header = ["plan", "fsdp", "frozen dtype", "DiT per device: replicated / FSDP (GB)", "DiT calls per iteration",
              "all-gathered per device per iteration, FSDP", "chosen"]
    return "\n\n".join([table(header, rows), provenance(src, "python benchmarks/memory_plan.py --traffic",
                                                         "machine not recorded (a hand count, not a timing)")])


def render_attention_memory(src: Source) -> str:
    d = src.data
    rows = []
    for name, imp in d["implementations"].items():
        kept = sig3(imp["per_row"]["residual"] / GB)
        if "backward_workspace" in imp["per_row"]:
            kept += f" (+{sig3(imp['per_row']['backward_workspace'] / GB)} dQ workspace)"
        rows.append([name, sig3(imp["per_row"]["forward"] / GB), sig3(imp["per_chunk"]["forward"] / GB), kept])
    note = (f"GB per SD3.5-M attention at {d['resolution']} px: {n0(d['S'])} tokens, {d['heads']} heads of {d['head_dim']}, "
            f"bf16 (splash pads to {n0(d['splash_S_padded'])}, blocks of {d['splash_block']}).")
    return "\n\n".join([table(["attention", "forward, GB per image", f"forward, {d['chunk_rows']}-row chunk",
                               "kept for the backward, per image"], rows), note,
                        provenance(src, "python benchmarks/memory_plan.py --attention", "machine not recorded (a hand count)")])


def render_simulated_pod(src: Source) -> str:
    d = src.data
    rows = [[p["phase"], f1(p["seconds"]), "yes" if p["ok"] else "**no**", p.get("note", "")] for p in d["phases"]]
    note = (f"{d['what']}: {d['accelerator']}, {d['workers']} workers, {f1(d['total_s'])} s in all, commit {d['commit']}; "
            f"saved step {d['saved_step']} at the stop, ended at step {d['final_step']}.")
    return "\n\n".join([table(["phase", "s", "ok", "what it checked"], rows), note,
                        provenance(src, "python benchmarks/simulated_pod.py", machine(), d["date"][:10])])


def render_preemption_drill(src: Source) -> str:
    d = src.data["preemption_drill"]
    rows = [[p["phase"], f1(p["seconds"]), "yes" if p["ok"] else "**no**", p.get("note", "")] for p in d["phases"]]
    recovery = ", ".join(f"{k.replace('_', ' ')} {f1(v)} s" for k, v in d["recovery_s"].items())
    note = (f"{d['what']}; {d['workers']} workers, {d['iterations']} iterations, commit {d['commit']}. Recovery by phase: "
            f"{recovery}.")
    return "\n\n".join([table(["phase", "s", "ok", "what it checked"], rows), note,
                        provenance(src, "python benchmarks/simulated_pod.py --scenario preempt", machine(), d["date"][:10])])


def render_goodput(src: Source) -> str:
    d = src.data
    rows = []
    for name, p in d["plans"].items():
        s = p["shares"]
        goodput = pct(p["goodput"]) if p["goodput"] >= 0.9 else bold(pct(p["goodput"]))
        rows.append([name, f"{p['chips']} x {p['chip']}", f1(p["iteration_s"]), n0(p["eval_s"]), f1(p["total_h"]), goodput,
                     pct(s["load_compile"]), pct(s["eval"]), pct(s["checkpoint"]), pct(s["preemptions"]),
                     f"{p['checkpoint_every']} ({pct(p['checkpoint_share_of_iteration'])})", n0(p["per_preemption_s"])])
    header = ["plan", "chips", "iteration, s", "one eval, s", "run, h", "training", "load + compile", "evals", "checkpoints",
              "preemptions", "save every (its block / iteration)", "a preemption costs, s"]
    a = d["assumed"]
    note = (f"Shares of the run's wall time, `configs/sd35m_pickscore.py` (1,000 iterations, {d['test_prompts']:,} test prompts "
            f"at every eval) at {d['mfu']:.0%} MFU and {d['preemptions_per_day']:g} preemption per day. Measured: FLOPs "
            f"(throughput_on_paper.json) and a save's blocking part ({f3(d['checkpoint_blocking_s'])} s, checkpoint_cost.json). "
            f"Assumed, never measured on a TPU: loading {a['load_s']} s, compiling {a['compile_first_s']} s "
            f"({a['compile_cached_s']} s from the cache), recovery " + ", ".join(f"{k} {v} s" for k, v in a["recovery_s"].items()) + ".")
    return "\n\n".join([table(header, rows), note, provenance(src, "python benchmarks/goodput_on_paper.py", "on paper")])


def render_checkpoint_cost(src: Source) -> str:
    d = src.data
    rows = [[f2(d["state_bytes"] / GB), f3(d["blocking_s"]), f3(d["written_s"]), str(d["repeats"])]]
    return "\n\n".join([table(["LoRA train state, GB", "save blocks the loop, s", "written after, s", "saves (median)"], rows),
                        provenance(src, "python benchmarks/checkpoint_cost.py", machine(d.get("env")), d["env"]["date"])])


# ----------------------------------------------------------------------------------------------------------------------
# The registry, rendering and checking

R = "benchmarks/results/"
REPORTS = {  # block name -> (results file or folder, relative to the repository root; renderer)
    "shapes_eval": (R + "shapes_eval.json", render_shapes_eval),
    "shapes32": ("flowrl_jax/assets/shapes32/MANIFEST.json", render_shapes32),
    "quickstart": (R + "quickstart", render_quickstart),
    "compare": (R + "compare", render_compare),
    "compare_one_seed": (R + "compare_methods.json", render_compare_one_seed),
    "compare_current_reward": (R + "current_reward/compare_methods.json", render_compare_one_seed),
    "compare_current_reward_seed1": (R + "current_reward_seed1/compare_methods.json", render_compare_one_seed),
    "compare_issue20": (R + "issue20/compare_methods.json", render_compare_issue20),
    "gradient_snr": (R + "gradient_snr.json", render_gradient_snr),
    "lambda_budget": (R + "lambda_budget.json", render_lambda_budget),
    "lambda_budget_shift3": (R + "lambda_budget_shift3.json", render_lambda_budget),
    "sampler_gap": (R + "sampler_gap.json", render_sampler_gap),
    "compare_torch": (R + "compare_torch.json", render_compare_torch),
    "profile_step": (R + "profile_step_medium.json", render_profile_step),
    "compile_time": (R + "compile_time.json", render_compile_time),
    "rl_step": (R + "rl_step.json", render_rl_step),
    "dit_forward": (R + "dit_forward.json", render_dit_forward),
    "leapalign_memory": (R + "memory.json", render_leapalign_memory),
    "throughput_on_paper": (R + "throughput_on_paper.json", render_throughput_on_paper),
    "text_cache": (R + "text_cache.json", render_text_cache),
    "reward_throughput": (R + "reward_throughput.json", render_reward_throughput),
    "reward_service": (R + "reward_service.json", render_reward_service),
    "reward_attacks": (R + "reward_attacks.json", render_reward_attacks),
    "memory_plan": (R + "memory_plan.json", render_memory_plan),
    "memory_plan_leapalign": (R + "memory_plan.json", render_memory_plan_leapalign),
    "methods_on_flux": (R + "methods_on_flux.json", render_methods_on_flux),
    "memory_plan_flux": (R + "memory_plan_flux1_dev.json",
                         lambda src: render_memory_plan(src, "python benchmarks/memory_plan.py --model flux1_dev")),
    "memory_plan_flux_leapalign": (R + "memory_plan_flux1_dev.json", lambda src: render_memory_plan_leapalign(
        src, "python benchmarks/memory_plan.py --model flux1_dev --method leapalign")),
    "frozen_dit_traffic": (R + "frozen_dit_traffic.json", render_frozen_dit_traffic),
    "attention_memory": (R + "attention_memory.json", render_attention_memory),
    "simulated_pod": (R + "simulated_pod.json", render_simulated_pod),
    "preemption_drill": (R + "simulated_pod.json", render_preemption_drill),
    "goodput": (R + "goodput_on_paper.json", render_goodput),
    "checkpoint_cost": (R + "checkpoint_cost.json", render_checkpoint_cost),
}


def render(name: str, root: str = ROOT) -> str:
    """Block `name`'s body as it should stand between its markers (with the newlines that put them on their own lines)."""
    rel, fn = REPORTS[name]
    return "\n" + fn(Source(rel, root)) + "\n"


def doc_files(root: str = ROOT) -> list[str]:
    files = []
    for pattern in DOC_GLOBS:
        files += sorted(glob.glob(os.path.join(root, pattern)))
    return files


def blocks(text: str) -> list[tuple[str, str]]:
    return [(m.group("name"), m.group("body")) for m in BLOCK.finditer(text)]


def _same(a: str, b: str, dates: bool) -> bool:
    return a == b if dates else DATE_FIELD.sub("date: ?", a) == DATE_FIELD.sub("date: ?", b)


def check(root: str = ROOT) -> list[str]:
    """One line per stale or unknown block in README.md and docs/*.md; [] when every block is current."""
    dates = git_available(root)
    problems = []
    for path in doc_files(root):
        rel = os.path.relpath(path, root)
        with open(path) as f:
            for name, body in blocks(f.read()):
                if name not in REPORTS:
                    problems.append(f"{rel}: report:{name}: no renderer of that name in benchmarks/report.py REPORTS")
                elif not _same(body, render(name, root), dates):
                    problems.append(f"{rel}: report:{name}: stale against {REPORTS[name][0]} (run python benchmarks/report.py)")
    return problems


def update(root: str = ROOT) -> list[str]:
    """Rewrite every known block in place; the files that changed."""
    dates = git_available(root)

    def block(m):
        name = m.group("name")
        if name not in REPORTS:
            return m.group(0)
        body = render(name, root)
        if not dates and _same(m.group("body"), body, False):
            return m.group(0)  # without git the dates cannot be recomputed: a current block keeps its own
        return f"<!-- report:{name} -->{body}<!-- /report:{name} -->"

    changed = []
    for path in doc_files(root):
        with open(path) as f:
            text = f.read()
        new = BLOCK.sub(block, text)
        if new != text:
            with open(path, "w") as f:
                f.write(new)
            changed.append(os.path.relpath(path, root))
    return changed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="list the stale blocks and exit 1; write nothing")
    parser.add_argument("--root", default=ROOT, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.check:
        problems = check(args.root)
        for p in problems:
            print(p)
        if not problems:
            print("every report block is current")
        return 1 if problems else 0
    changed = update(args.root)
    print("rewrote " + ", ".join(changed) if changed else "every report block was already current")
    for p in check(args.root):  # unknown names are left as they are
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
