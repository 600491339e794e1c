"""The `export_asset` job: ship a pretrain workdir's EMA weights as `flowrl_jax/assets/<export.name>/`.

    python -m flowrl_jax.main --config configs/export_shapes32.py

Writes the asset (`assets.export`), measures it as loaded (the GenEval-style table on test.jsonl) and
records the table, the training steps and the settings in its MANIFEST.json.
"""
from __future__ import annotations

import json
import os

import jax

from flowrl_jax.worlds.shapes import assets, geneval
from flowrl_jax.data import shapes


def run(config, workdir: str | None) -> dict:
    cfg, e = config.export, config.export.eval
    folder, step = assets.export(cfg.workdir, cfg.name)
    assets.write_manifest(folder, {"name": cfg.name})  # provisional, so that the asset loads for measuring
    pipe, params, _ = assets.load_pipeline(cfg.name)
    result = geneval.geneval(pipe, params, shapes.load_prompts("test"), jax.random.PRNGKey(config.seed), e.samples_per_prompt,
                              e.batch_size, e.num_steps, e.cfg, e.shift, progress=True)
    print(geneval.format_table(result["table"]))
    with open(os.path.join(folder, "model.json")) as f:
        model = json.load(f)
    assets.write_manifest(folder, {"name": cfg.name, "source": cfg.workdir, "training_steps": step, "model": model,
                                   "test_eval": result["table"], "test_eval_settings": e.to_dict(), "notes": cfg.notes})
    geneval.category_grid(result, os.path.join(workdir or cfg.workdir, f"{cfg.name}_test_grid.png"))
    print(f"exported {folder}")
    return result["table"]
