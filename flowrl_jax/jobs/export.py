"""The `export` job: a train run's policy as the files diffusers, PEFT and other tools load, each with a model card.

    python -m flowrl_jax.main --config configs/<the run's config>.py --config.job=export --workdir <the run's workdir>

Which weights: `config.policy` (`rl/trained.py`: the newest checkpoint or `policy.step`, EMA or not; or an imported
`policy.lora`, e.g. to convert a flow_grpo adapter to a merged folder). `export.formats`, comma-separated:
- `lora`: `pytorch_lora_weights.safetensors`, what `StableDiffusion3Pipeline.load_lora_weights(folder)` loads;
- `peft`: `adapter_config.json` + `adapter_model.safetensors`, flow_grpo's layout (`PeftModel.from_pretrained`);
- `merged`: an `SD3Transformer2DModel.from_pretrained` folder (config.json + safetensors shards of at most
  `export.max_shard_gb`, in `export.dtype`): the whole trained DiT, or the LoRA folded into its base;
- `auto` (default): `lora,peft` for a LoRA, `merged` for a whole-DiT run.
Each goes to `<out>/<format>/` with a README.md model card (the base, the method and its config, the steps, the rewards,
the last eval table, the commands); `out` is `export.out`, else `<workdir>/export/<weights>`. The weights are read and
written on the host, tensor by tensor (`models/lora_files.py`, `convert.save_diffusers`); process 0 writes.
"""
from __future__ import annotations

import json
import os

import jax
import ml_dtypes
import numpy as np

from flowrl_jax import config_lib, paths
from flowrl_jax.config_lib import ConfigError
from flowrl_jax.models import convert, lora_files
from flowrl_jax.rl import trained

FORMATS = ("lora", "peft", "merged")
DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}


def formats_of(text: str, has_lora: bool) -> list[str]:
    if text == "auto":
        return ["lora", "peft"] if has_lora else ["merged"]
    chosen = [f.strip() for f in text.split(",") if f.strip()]
    unknown = [f for f in chosen if f not in FORMATS]
    if unknown or not chosen:
        raise ConfigError(f"export.formats={text!r}: give 'auto' or a comma-separated subset of {', '.join(FORMATS)}")
    if not has_lora and set(chosen) & {"lora", "peft"}:
        raise ConfigError("export.formats: lora and peft need a LoRA (train.lora_rank > 0 or policy.lora); this policy is a "
                          "whole DiT: export it as merged")
    return chosen


def run(config, workdir: str | None) -> dict:
    e = config.export
    if e.dtype not in DTYPES:
        raise ConfigError(f"export.dtype={e.dtype!r}: choose one of {', '.join(DTYPES)}")
    chosen = formats_of(e.formats, bool(config.train.lora_rank or config.policy.lora))  # checked before loading the model
    run_ = trained.load(config, workdir)
    if run_.step == 0 and run_.adapters is None:
        raise ConfigError(f"nothing trained to export: --workdir {workdir} has no checkpoint (and no policy.lora was given)")
    out = trained.output_folder("export.out", e.out, workdir, "export", run_.tag)
    written = {}
    if jax.process_index() == 0:
        base_name = config.world.get("pipeline") or config.world.get("base", "")
        for fmt in chosen:
            folder = os.path.join(out, fmt)
            if fmt == "lora":
                lora_files.write_diffusers_lora(folder, run_.adapters, run_.alpha, run_.base["dit"])
            elif fmt == "peft":
                lora_files.write_peft_adapter(folder, run_.adapters, run_.alpha, run_.base["dit"], base_name)
            else:
                convert.save_diffusers(folder, run_.dit, run_.dit_params(), DTYPES[e.dtype], e.max_shard_gb)
            with open(os.path.join(folder, "README.md"), "w") as f:
                f.write(model_card(config, run_, fmt, workdir))
            written[fmt] = folder
            print(f"exported {fmt}: {folder}")
    return {"out": out, "formats": chosen, "folders": written, "step": run_.step, "source": run_.source}


LOAD_SNIPPETS = {
    "lora": "pipe = StableDiffusion3Pipeline.from_pretrained(BASE, torch_dtype=torch.bfloat16)\npipe.load_lora_weights(FOLDER)",
    "peft": "from peft import PeftModel\npipe = StableDiffusion3Pipeline.from_pretrained(BASE, torch_dtype=torch.bfloat16)\n"
            "pipe.transformer = PeftModel.from_pretrained(pipe.transformer, FOLDER)",
    "merged": "transformer = SD3Transformer2DModel.from_pretrained(FOLDER, torch_dtype=torch.bfloat16)\n"
              "pipe = StableDiffusion3Pipeline.from_pretrained(BASE, transformer=transformer, torch_dtype=torch.bfloat16)",
}


def model_card(config, run_: trained.Trained, fmt: str, workdir: str | None) -> str:
    """README.md of an export: what it is, how to load it, and how it was made."""
    base = config.world.get("pipeline") or config.world.get("base", "")
    method = config.objective.name + (f" + credit {', '.join(config.credit.names)}" if tuple(config.credit.names) != ("uniform",) else "")
    evals = run_.meta.get("history", {}).get("evals", [])
    last = evals[-1] if evals else None
    launch = os.path.join(workdir or "", "run.json")
    recorded = {}
    if workdir and paths.exists(launch):  # the train job's record of its command and config
        with paths.open_file(launch) as f:
            recorded = json.load(f)
    train_command = recorded.get("command")
    run_config = json.dumps(recorded["config"], indent=2) if "config" in recorded else config.to_json_best_effort(indent=2)
    lines = ["---", "library_name: diffusers", f"tags: [flowrl_jax, {config.objective.name}, {'lora' if fmt != 'merged' else 'sd3'}]",
             "---", f"# {config.objective.name} fine-tune of {os.path.basename(os.path.normpath(base)) or base}", "",
             f"- **Weights**: {run_.source}; {fmt} export (`flowrl_jax/jobs/export.py`).",
             f"- **Base model**: `{base}` ({config.world.name} world).",
             f"- **Method**: {method}; sampler {config.sampler.kind}, {config.sampler.num_steps} steps.",
             f"- **Steps trained**: {run_.step} iterations of {config.train.prompts_per_iteration} prompts x "
             f"{config.train.group_size} samples.",
             f"- **Rewards**: {', '.join(f'{n} x {w}' for n, w in run_.rewards) or '(none)'}.",
             ]
    if run_.adapters is not None:
        folded = " (folded into lora_B in this file, which records lora_alpha = r)" if fmt == "lora" else ""
        lines.append(f"- **LoRA**: rank {lora_files.rank_of(run_.adapters)}, alpha {run_.alpha:g}{folded}, on "
                     f"{', '.join(lora_files.target_modules(run_.adapters, run_.base['dit']))}.")
    lines += ["", "## Load it", "```python", "import torch", "from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline",
              f"BASE, FOLDER = {base!r}, {'.'!r}  # the base pipeline folder, this folder", LOAD_SNIPPETS[fmt], "```", ""]
    if last is not None:
        lines += [f"## Last eval (step {last['step']})", "", "| row | " + " | ".join(m for m in next(iter(last["table"].values()))) + " |",
                  "|---|" + "---|" * len(next(iter(last["table"].values())))]
        for row, values in last["table"].items():
            lines.append(f"| {row} | " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in values.values()) + " |")
        lines.append("")
    lines += ["## How it was made", ""]
    if train_command:
        lines += ["Trained with:", "```bash", train_command, "```"]
    lines += ["Exported with:", "```bash", config_lib.command_line() or "(flowrl_jax.jobs.export.run, from Python)", "```", "",
              "<details><summary>The run's config</summary>", "", "```json", run_config, "```", "</details>", ""]
    return "\n".join(lines)
