"""GenEval-style evaluation on the shapes world: sample every prompt, score it exactly, tabulate.

    table = geneval(pipe, params, prompts, rng, samples_per_prompt=1, ...)["table"]

Samples every prompt with the deterministic ODE sampler (CFG), scores the pixels with the exact
evaluator (`evaluator.py`) and reports per category and overall the strict accuracy
(GenEval's 0/1 correctness) and the partial-credit score (Flow-GRPO's). "overall" is the mean of
the per-category figures (GenEval's convention), so every category weighs the same.
"""
from __future__ import annotations

import jax
import numpy as np
from tqdm import tqdm

from flowrl_jax import metrics, parallel
from flowrl_jax.data import shapes
from flowrl_jax.worlds.shapes import evaluator


def make_sampler(pipe, num_steps: int, cfg: float, shift: float):
    """jit-compiled `(params, ids, mask, rng) -> images`."""
    return jax.jit(lambda params, ids, mask, rng: pipe.sample(params, ids, mask, rng, num_steps, cfg, shift))


def geneval(pipe, params, prompts: list[dict], rng, samples_per_prompt: int = 1, batch_size: int = 64,
            num_steps: int = 20, cfg: float = 4.0, shift: float = 1.0, sampler=None, progress: bool = False) -> dict:
    """-> {"table": {category: {"strict", "score", "n"}, "overall": {...}}, "images", "records"}."""
    sampler = sampler or make_sampler(pipe, num_steps, cfg, shift)
    rows = [p for p in prompts for _ in range(samples_per_prompt)]
    images, strict, score = [], [], []
    starts = range(0, len(rows), batch_size)
    for i, start in enumerate(tqdm(starts, desc="eval", disable=not progress, leave=False)):
        chunk = rows[start : start + batch_size]
        pad = batch_size - len(chunk)  # one compiled shape: pad the last batch
        ids, mask = pipe.tokenize([r["prompt"] for r in chunk] + [""] * pad)
        out = parallel.to_host(sampler(params, ids, mask, jax.random.fold_in(rng, i)))[: len(chunk)]  # gathered on every host
        result = evaluator.evaluate(out, [r["spec"] for r in chunk])
        images.append(out)
        strict.append(result["strict"])
        score.append(result["score"])
    images, strict, score = np.concatenate(images), np.concatenate(strict), np.concatenate(score)
    table = {}
    for category in shapes.CATEGORIES:
        sel = np.array([r["category"] == category for r in rows])
        if sel.any():
            table[category] = {"strict": float(strict[sel].mean()), "score": float(score[sel].mean()), "n": int(sel.sum())}
    table["overall"] = {"strict": float(np.mean([v["strict"] for v in table.values()])),
                        "score": float(np.mean([v["score"] for v in table.values()])), "n": len(rows)}
    return {"table": table, "images": images, "strict": strict, "score": score, "rows": rows}


def format_table(table: dict) -> str:
    lines = [f"{'category':14s} {'strict':>7s} {'score':>7s} {'n':>6s}"]
    for name, v in table.items():
        lines.append(f"{name:14s} {v['strict']:7.3f} {v['score']:7.3f} {v['n']:6d}")
    return "\n".join(lines)


def category_grid(result: dict, path: str, per_category: int = 8) -> str:
    """A PNG with one row per category: the first `per_category` samples, captioned by prompt."""
    picks, titles = [], []
    for category in shapes.CATEGORIES:
        idx = [i for i, r in enumerate(result["rows"]) if r["category"] == category][:per_category]
        if idx:
            picks += idx + [idx[-1]] * (per_category - len(idx))
            titles.append(category)
    labels = [("+ " if result["strict"][i] else "- ") + result["rows"][i]["prompt"] for i in picks]
    return metrics.save_grid(result["images"][picks], path, rows=len(titles), labels=labels, scale=4, row_titles=titles)
