"""Every method config on FLUX: each `configs/<method>.py`'s objective, credit, sampler kind and window, run for one
iteration by the train job on a tiny random FLUX.1-dev-like pipeline (tests/test_flux.py's `build_tiny_flux`), in the
flux world, with PickScore (a tiny random CLIP folder) as the reward. A method runs, or its error is recorded.

    python benchmarks/methods_on_flux.py [--methods flow_grpo,nft] [--out benchmarks/results/methods_on_flux.json]

What each method keeps of its config: `objective`, `credit`, `advantage`, `curriculum` and the sampler's kind, noise
level, SDE window and window schedule. What the world sets: the pipeline, 16-pixel images, 3 steps on the "flux" grid at
FluxPipeline's shift, no CFG (`sampler.cfg = eval.cfg = 1`, FLUX is guidance-distilled), 2 prompts x 4, LoRA rank 4.
This is a smoke run (does the method go through the loop on FLUX), not a comparison: one iteration, random weights.
Needs torch, diffusers and transformers (the tests' install) to build the tiny folders.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

import numpy as np  # noqa: E402

METHODS = {"flow_grpo": "flow_grpo.py", "flow_grpo_fast": "flow_grpo_fast.py", "grpo_guard": "grpo_guard.py",
           "mixgrpo": "mixgrpo.py", "lambda_grpo": "lambda_grpo.py", "lc_grpo": "lc_grpo.py", "spatial": "spatial.py",
           "stepwise": "stepwise.py", "tp_grpo": "tp_grpo.py", "adagrpo": "adagrpo.py", "advantage_flow": "advantage_flow.py",
           "nft": "nft.py", "leapalign": "leapalign.py"}
KEPT = ("objective", "credit", "advantage", "curriculum")
SAMPLER_KEPT = ("kind", "noise_level", "logprob_form", "same_noise_per_group", "window")


def flux_config(method_path: str, folder: str, prompts: str, pickscore: str):
    """The FLUX pickscore preset, shrunk to the tiny pipeline, with the method's own pieces (module doc)."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift
    from flowrl_jax.config_lib import load_config
    from tests.test_sd3 import CLIP_LEN, RESOLUTION, T5_LEN

    method = load_config(method_path)
    config = load_config(os.path.join(ROOT, "configs", "flux1_dev_pickscore.py"))
    config.unlock()
    for key in KEPT:
        config[key] = method[key]
    for key in SAMPLER_KEPT:
        config.sampler[key] = method.sampler[key]
    steps = 3
    start, size = tuple(method.sampler.sde_window) or (0, steps)
    shift = float(np.exp(calculate_shift(16, 256, 4096, 0.5, 1.15)))
    config.sampler.update(num_steps=steps, shift=shift, sde_window=() if not method.sampler.sde_window else (min(start, steps - 1), min(size, steps - min(start, steps - 1))))
    if method.sampler.window.get("range"):
        config.sampler.window["range"] = (0, steps)
    options = config.objective.get(config.objective.name)
    if options is not None and options.get("train_cfg", 0.0) not in (0.0, 1.0):
        options.train_cfg = 0.0  # the sampler's (1): FLUX has no CFG
    if options is not None and "timesteps" in options:
        options.timesteps = min(options.timesteps, steps)  # the forward-process objectives' times, of the 3 steps
    config.world.update(pipeline=folder, train_prompts=prompts, test_prompts=prompts, resolution=RESOLUTION,
                        clip_max_length=CLIP_LEN, t5_max_length=T5_LEN, dtype="float32", param_dtype="float32")
    config.world.reward_models.pickscore = pickscore
    config.train.update(iterations=1, prompts_per_iteration=2, group_size=4, minibatches=1, lora_rank=4, microbatch=0,
                        rollout_chunk=0)
    config.eval.update(at_start=False, every=0, shift=shift)
    config.checkpoint.every = 0
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "methods_on_flux.json"))
    args = parser.parse_args()
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    from flowrl_jax import main as job
    from tests.test_flux import build_tiny_flux
    from tests.test_sd3 import _prompt_dataset
    from tests.test_clip import _processor, _reference, _tokenizer
    import pathlib

    root = pathlib.Path(tempfile.mkdtemp(prefix="methods_on_flux_"))
    folder = str(root / "flux")
    build_tiny_flux(folder)
    prompts = _prompt_dataset(root)
    pickscore = root / "pickscore"
    tokenizer = _tokenizer()
    _reference("gelu", legacy_eos=False, vocab_size=len(tokenizer)).save_pretrained(pickscore)
    _processor(tokenizer).save_pretrained(pickscore)
    results = {}
    for name in args.methods.split(","):
        t0 = time.time()
        try:
            config = flux_config(os.path.join(ROOT, "configs", METHODS[name]), folder, prompts, str(pickscore))
            job.run_job(config, str(root / name))
            row = [json.loads(line) for line in open(root / name / "metrics.jsonl") if '"reward"' in line][-1]
            results[name] = {"ran": True, "objective": config.objective.name, "credit": list(config.credit.names),
                             "kernel": config.sampler.kind, "loss": row.get("loss"), "reward": row.get("reward"),
                             "seconds": time.time() - t0}
        except Exception as e:  # noqa: BLE001 (recorded: the point is which methods refuse and why)
            results[name] = {"ran": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                             "trace": traceback.format_exc()[-2000:], "seconds": time.time() - t0}
        print(f"{name:15s} {'ran' if results[name]['ran'] else 'refused/failed':15s} "
              f"{results[name].get('error', '') or 'loss ' + format(results[name]['loss'], '.4g')}", flush=True)
    from machine import describe  # benchmarks/machine.py (this script's folder)
    with open(args.out, "w") as f:
        json.dump({"env": describe(), "methods": results}, f, indent=2)


if __name__ == "__main__":
    main()
