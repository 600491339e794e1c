"""The `eval_base` job: the GenEval-style table of a shapes-world base model (a shipped asset or a pretrain workdir).

    python -m flowrl_jax.main --config configs/eval_shapes.py --config.eval.checkpoint=shapes32

Loads a shipped asset or a pretrain workdir (`worlds/shapes/assets.py`), samples the split's prompts with the
ODE sampler (CFG) and prints the table (`worlds/shapes/geneval.py`); process 0 writes `eval.json` and
`eval_grid.png` to the workdir (`workdirs/eval` when none is given).
"""
from __future__ import annotations

import json
import os

import jax

from flowrl_jax import metrics
from flowrl_jax.data import shapes
from flowrl_jax.worlds.shapes import assets
from flowrl_jax.worlds.shapes.geneval import category_grid, format_table, geneval


def run(config, workdir: str | None) -> dict:
    """The eval job: load a checkpoint (shipped name or workdir), print the table, write JSON + PNG."""
    cfg = config.eval
    pipe, params, info = assets.load_pipeline(cfg.checkpoint, use_ema=cfg.use_ema)
    prompts = shapes.load_prompts(cfg.split)
    if cfg.max_prompts:
        prompts = prompts[: cfg.max_prompts]
    result = geneval(pipe, params, prompts, jax.random.PRNGKey(config.seed), cfg.samples_per_prompt, cfg.batch_size,
                     cfg.num_steps, cfg.cfg, cfg.shift, progress=True)
    if not metrics.is_writer():  # process 0 reports and writes
        return result["table"]
    print(f"GenEval-style table: {info['name']} on {cfg.split} ({len(prompts)} prompts x {cfg.samples_per_prompt}, "
          f"ODE {cfg.num_steps} steps, cfg {cfg.cfg}, shift {cfg.shift})")
    print(format_table(result["table"]))
    out_dir = workdir or os.path.join("workdirs", "eval")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "eval.json"), "w") as f:
        json.dump({"checkpoint": info, "eval": cfg.to_dict(), "table": result["table"]}, f, indent=2)
    category_grid(result, os.path.join(out_dir, "eval_grid.png"))
    print(f"wrote {out_dir}/eval.json and eval_grid.png")
    return result["table"]
