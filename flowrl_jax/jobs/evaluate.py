"""The `evaluate` job: a train run's policy (or its base, or a LoRA trained elsewhere) on a prompt set, scored as the
train loop's eval scores it.

    python -m flowrl_jax.main --config configs/<the run's config>.py --config.job=evaluate --workdir <the run's workdir> \\
        --config.evaluate.prompts=geneval_metadata.jsonl      # "" = the run's own test prompts (config.world.test_prompts)

Which weights: `config.policy` (`rl/trained.py`). The prompts replace the world's test set (`world.test_prompts`: a
JSONL, a text file or an ArrayRecord dataset for the sd3 world; the shapes world's own JSONL or dataset), and the eval is
the world's own `evaluate`, the function the train loop calls: the same sampler settings (`config.eval`: samples per
prompt, steps, CFG, shift, noise seed), the run's rewards (`train.rewards`, on the device, the host or a reward server),
sharded over the mesh's batch axes, per category where the prompt rows carry one ("tag", GenEval's metadata, or
"category"). Process 0 prints the table and writes `<out>/evaluate.json` (the table, the weights, the settings) and the
eval's grid; `out` is `evaluate.out`, else `<workdir>/evaluate/<weights>`.
"""
from __future__ import annotations

import json
import os

import jax

from flowrl_jax.rl import trained

def run(config, workdir: str | None) -> dict:
    cfg = config.evaluate
    if cfg.prompts:
        with config.unlocked():
            config.world.test_prompts = cfg.prompts
    run_ = trained.load(config, workdir, rewards_required=True)
    world = run_.world
    out = trained.output_folder("evaluate.out", cfg.out, workdir, "evaluate", run_.tag)
    frozen = run_.place(run_.base)
    evaluation = world.evaluate(run_.placed_dit_params(frozen["dit"]), frozen, run_.step, out)
    table = evaluation.entry["table"]
    if jax.process_index() == 0:
        print(f"{world.eval_name}: {run_.source} on {config.world.test_prompts or 'the test prompts'}")
        print(format_table(table))
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "evaluate.json"), "w") as f:
            json.dump({"weights": run_.source, "step": run_.step, "prompts": config.world.test_prompts,
                       "rewards": [list(r) for r in run_.rewards], "eval": config.eval.to_dict(), "table": table}, f, indent=2)
        print(f"wrote {out}/evaluate.json")
    return {"table": table, "step": run_.step, "out": out, "source": run_.source}


def format_table(table: dict) -> str:
    """{row: {metric: value}} as aligned text, one line per row (`n`, the row's sample count, last)."""
    if not table:
        return "(no rows: the prompt set is empty)"
    metrics_ = [m for m in next(iter(table.values())) if m != "n"]
    lines = [f"{'':16s}" + "".join(f"{m:>14s}" for m in metrics_) + f"{'n':>7s}"]
    for row, values in table.items():
        lines.append(f"{row:16s}" + "".join(f"{values.get(m, float('nan')):14.4f}" for m in metrics_) + f"{values.get('n', 0):7d}")
    return "\n".join(lines)

