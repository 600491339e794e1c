"""The policy a train run wrote, read back on the host: what the after-training jobs (sample, evaluate, export) start from.

    run = trained.load(config, workdir)    # the train config, its --workdir; `config.policy` picks the step and the weights
    run.world, run.dit, run.base           # the world built and loaded, its base weights (host numpy)
    run.adapters, run.alpha                # the LoRA (host) of a LoRA run or an imported file; None for a whole-DiT run or the base
    frozen = run.place(run.base)           # on the run's mesh by its partition rules (config.mesh, partition_rules)
    dit_params = run.placed_dit_params(frozen["dit"])   # the DiT to sample with: the LoRA folded in, or the whole trained DiT
    host = run.dit_params()                # the same on the host, one kernel at a time (what export writes)

`config.policy`: `step` -1 is the workdir's newest checkpoint (the base when it has none), 0 the base, N that step;
`use_ema` reads the EMA (what the train loop's eval samples) or the live params; `lora` a LoRA trained elsewhere (a PEFT
adapter folder such as flow_grpo's, or a diffusers LoRA file: `models/lora_files.py`), used instead of a checkpoint.
Only the one field of the saved state is read, as numpy (`Checkpointer.restore_fields`): no device holds a whole tensor.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

from flowrl_jax import parallel, paths, worlds
from flowrl_jax.checkpoint import Checkpointer
from flowrl_jax.config_lib import ConfigError
from flowrl_jax.models import lora, lora_files
from flowrl_jax.rl import plan

DEFAULTS = dict(step=-1, use_ema=True, lora="")


@dataclasses.dataclass
class Trained:
    world: Any
    mesh: Any                # the run's mesh (config.mesh)
    place: Callable          # host tree -> global arrays by the run's partition rules (`worlds.RunFacts.place`)
    rewards: tuple           # ((name, weight), ...) the run trained on (`run_rewards`)
    dit: Any                 # the world's MMDiT
    base: dict               # the world's frozen weights {"dit", "text", ...} (host)
    step: int                # the iteration the weights are from (0: the base, or an imported LoRA)
    source: str              # what was read, in words: "the base", "step 40 (EMA) of <workdir>", "the LoRA <path>"
    adapters: Any = None     # LoRA adapters {module: {"a", "b"}} (host), or None
    alpha: float = 0.0       # the adapters' scale numerator: W + (alpha / r) a b
    whole: Any = None        # a whole-DiT run's trained params (host), or None
    meta: dict = dataclasses.field(default_factory=dict)  # the checkpoint's meta ({"step", "history"}) or {}
    lora_path: str = ""      # the imported LoRA's path (config.policy.lora), or ""

    @property
    def tag(self) -> str:
        """A folder name for what was read: "base", "step_000040", "lora_<name>"."""
        if self.lora_path:
            return "lora_" + os.path.basename(os.path.normpath(self.lora_path))
        return f"step_{self.step:06d}" if self.step else "base"

    def placed_dit_params(self, frozen_dit) -> dict:
        """The DiT params to sample with, on the mesh: the LoRA folded into `frozen_dit` (the base, placed) on the device
        by `lora.merge`, as the train loop's eval folds it (`Policy.merged`), or the whole trained DiT or the base placed."""
        if self.adapters is not None:
            return lora.merge(frozen_dit, self.place(self.adapters), self.alpha)
        return frozen_dit if self.whole is None else self.place(self.whole)

    def dit_params(self) -> dict:
        """The DiT params to export (host): the whole trained DiT, or the base with the LoRA folded in (float32
        `W + (alpha / r) a b`, cast back to the kernel's dtype), or the base."""
        if self.whole is not None:
            return self.whole
        if self.adapters is None:
            return self.base["dit"]
        return lora.merge(self.base["dit"], self.adapters, self.alpha)  # numpy in, numpy out: on the host, kernel by kernel


def output_folder(option: str, value: str, workdir: str | None, kind: str, tag: str) -> str:
    """Where an after-training job writes: `value` (the `option` field), else `<workdir>/<kind>/<tag>`; a local folder
    (the files go to tools that read local paths; copy them to a bucket afterwards)."""
    out = value or os.path.join(workdir or "workdirs", kind, tag)
    if paths.is_url(out):
        raise ConfigError(f"{option}: {out} is a bucket URL; these files are written to a local folder: pass --config.{option}=/local/path")
    return out


def _checkpoint_step(ckpt: Checkpointer, wanted: int) -> int:
    steps = ckpt.all_steps()
    if wanted == -1:
        return steps[-1] if steps else 0
    if wanted and wanted not in steps:
        raise ConfigError(f"config.policy.step={wanted}: no such checkpoint in {ckpt.directory} (have {steps or 'none'})")
    return wanted


def run_rewards(config, required: bool) -> tuple:
    """The rewards the run trained on, resolved as the train job resolves them (`plan.train_rewards`: a preset's model-free
    demo where its reward's weights are not given). `required`: a run that cannot resolve them is a ConfigError; else
    `train.rewards` as written."""
    try:
        weighted, warning = plan.train_rewards(config)
    except ConfigError:
        if required:
            raise
        return tuple((str(n), float(w)) for n, w in config.train.rewards)
    if warning and required:
        print(f"warning: {warning}")
    return weighted


def load(config, workdir: str | None, rewards_required: bool = False) -> Trained:
    """The world of the train `config` (loaded) and the policy `config.policy` picks from `workdir`'s checkpoints;
    `rewards_required`: the world scores (the evaluate job), so the run's rewards must resolve (`run_rewards`)."""
    p = config.policy
    mesh = parallel.make_mesh(config.mesh)
    weighted = run_rewards(config, rewards_required)
    try:
        world = worlds.build(config, mesh, weighted)
        dit, base = world.load()
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(str(e).splitlines()[0]) from None
    loaded = (world, mesh, worlds.run_facts(config, mesh).place, weighted, dit, base)
    if p.lora:
        try:
            adapters, alpha = lora_files.read_lora(p.lora, base["dit"])
        except (lora_files.LoraFileError, FileNotFoundError) as e:
            raise ConfigError(f"config.policy.lora: {e}") from None
        return Trained(*loaded, 0, f"the LoRA {p.lora}", adapters, alpha, lora_path=p.lora)
    directory = os.path.join(workdir, "checkpoints") if workdir else ""
    if not directory or not paths.exists(directory):
        if p.step > 0:
            raise ConfigError(f"config.policy.step={p.step}: --workdir {workdir} has no checkpoints/ (pass the train run's --workdir)")
        return Trained(*loaded, 0, "the base")
    with Checkpointer(directory) as ckpt:
        step = _checkpoint_step(ckpt, p.step)
        if step == 0:
            return Trained(*loaded, 0, "the base")
        field = "ema" if p.use_ema else "params"
        fields, meta = ckpt.restore_fields(step, (field,))
    params = fields[field]
    source = f"step {step} ({'EMA' if p.use_ema else 'live params'}) of {workdir}"
    rank = config.train.lora_rank
    if rank:
        alpha = float(dit.lora_alpha)
        return Trained(*loaded, step, source, params, alpha, meta=meta)
    return Trained(*loaded, step, source, whole=params, meta=meta)
