"""The embedded shapes world (pixel space): GenEval-style prompts, the shipped base model, exact rewards.

    world = ShapesWorld(config.world, config.eval, facts)    # base (asset name or pretrain workdir), prompt files
    world = ShapesWorld(config.world, config.eval, facts, loaded=(pipe, params))   # a pipeline in memory instead of base

Prompt rows are {"prompt", "category", "spec"} (`data/shapes.py`); `sample_prompts` draws the category
uniformly first (the train set is unbalanced across categories). The DiT works on 32x32 RGB pixels
in [-1, 1], so `decode` is the identity. Rewards are `rewards.REWARDS` by name (this world's own: the exact
evaluator's score and strictness, the learned reward, `rewards.py`); the reward model is the shipped learned
reward. `evaluate` is the GenEval-style table (`geneval.geneval`: ODE sampler, CFG) on the test prompts, with the
sample grid `eval_<step>.png` and, optionally, the learned reward of the same images. The package holds everything
of this world: its pipeline (`pipeline.py`), shipped models (`assets.py`), exact evaluator (`evaluator.py`), the
GenEval-style table (`geneval.py`), the learned reward (`learned.py`) and its rewards (`scoring.py`).
"""
from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np

from flowrl_jax import rewards
from flowrl_jax.data import datasets, shapes
from flowrl_jax.rewards import device
from flowrl_jax.worlds.protocol import Evaluation, RewardModel, RunFacts
from flowrl_jax.worlds.shapes import assets, geneval, learned

DEFAULTS = {"base": "shapes32", "train_prompts": "", "test_prompts": "",  # prompt sets: "" = the shipped train / test sets
            "reward_models": dict(device.FOLDERS),  # the device rewards' weights (rewards/device.py), for any world
            "scan_blocks": "auto",  # the base DiT's runs of equal blocks as one lax.scan: "auto", "always", "never" (mmdit.py)
            "attention": "xla"}  # "xla"; "cudnn" (GPU flash attention); "splash" (TPU Pallas): models/attention.py


def load_prompt_set(path: str, split: str) -> list[dict]:
    """A JSONL prompt file, an ArrayRecord prompt dataset (a folder with `<split>.array_record`, or the file;
    `python -m flowrl_jax.data.datasets`), or "" for the shipped set -> rows {"prompt", "category", "spec"}."""
    if not path:
        return shapes.load_prompts(split)
    if path.endswith(".jsonl"):
        return shapes.load_prompt_file(path)
    ds = datasets.PromptDataset(path, split)
    rows = [ds[i] for i in range(len(ds))]
    missing = sorted({k for r in rows for k in ("prompt", "category", "spec") if k not in r})
    if missing:
        raise ValueError(f"prompt dataset {path} ({split}) has rows without {missing}: the shapes world needs "
                         '{"prompt", "category", "spec"} rows (convert a shapes JSONL set)')
    return rows


class ShapesWorld:
    eval_name, eval_rows = "GenEval-style table", "category"  # what the train job's before/after table is called
    eval_curves = {"eval/overall/strict": "eval strict (overall)", "eval/overall/score": "eval score (overall)"}

    def __init__(self, settings, eval_settings, facts: RunFacts | None = None, loaded=None):
        """`facts` is taken for the worlds' one signature and not needed here: the shapes world's weights are small enough
        to stay replicated, its decode is the identity and its eval scores exactly."""
        w, self.eval_cfg = settings, eval_settings
        self.loaded = loaded
        self.dit_fields = dict(scan_blocks=w.get("scan_blocks", "auto"), attention=w.get("attention", "xla"))
        self.base, self.reward_models = w.base, w.reward_models
        self.train_prompts = load_prompt_set(w.train_prompts, "train")
        test = load_prompt_set(w.test_prompts, "test")
        if self.eval_cfg.per_category:
            test = [p for c in shapes.CATEGORIES for p in [q for q in test if q["category"] == c][: self.eval_cfg.per_category]]
        self.test_prompts = test
        self.pipe, self._sampler, self._learned = None, None, None

    def load(self):
        """-> (dit, {"dit", "text"}) of the base model; a missing or corrupt one raises ValueError."""
        if self.loaded is not None:
            pipe, params = self.loaded
        else:
            try:
                pipe, params, _ = assets.load_pipeline(self.base, use_ema=True)
            except (FileNotFoundError, assets.AssetError, ValueError, OSError, KeyError) as e:
                raise ValueError(f"cannot load the base model {self.base!r} (config.world.base): {str(e).splitlines()[0]}") from None
        self.pipe = dataclasses.replace(pipe, dit=pipe.dit.clone(**self.dit_fields))  # the world's scan / attention fields
        return self.pipe.dit, params

    def tokenize(self, prompts):
        return self.pipe.tokenize([p["prompt"] for p in prompts])

    def encode(self, frozen, ids, mask):
        return self.pipe.encode(frozen["text"], ids, mask)

    def null_condition(self, frozen, batch: int):
        return self.pipe.null_condition(frozen["text"], batch)

    def latent_shape(self, batch: int):
        return self.pipe.image_shape(batch)

    def decode(self, frozen, x):
        return x

    def sample_prompts(self, n: int, rng: np.random.Generator) -> np.ndarray:
        by_category = {}
        for i, p in enumerate(self.train_prompts):
            by_category.setdefault(p["category"], []).append(i)
        names = sorted(by_category)
        return np.array([by_category[c][rng.integers(len(by_category[c]))] for c in (names[i] for i in rng.integers(len(names), size=n))])

    def reward_fn(self, weighted, remote_settings=None):
        return rewards.build(weighted, self.reward_models, remote_settings)

    def reward_model(self) -> RewardModel:
        return RewardModel(*learned.reward_model())

    def evaluate(self, dit_params, frozen, step: int, workdir: str) -> Evaluation:
        e = self.eval_cfg
        if self._sampler is None:
            self._sampler = geneval.make_sampler(self.pipe, e.num_steps, e.cfg, e.shift)
        result = geneval.geneval(self.pipe, {"dit": dit_params, "text": frozen["text"]}, self.test_prompts,
                                  jax.random.PRNGKey(self.eval_cfg.noise_seed), e.samples_per_prompt, e.batch_size, sampler=self._sampler,
                                  progress=True)
        geneval.category_grid(result, os.path.join(workdir, f"eval_{step:06d}.png"))
        table = result["table"]
        entry = {"table": table}
        scalars = {f"eval/{k}/{m}": v[m] for k, v in table.items() for m in ("strict", "score")}
        if e.learned_reward:  # the shipped learned reward on the same eval images (what LeapAlign optimizes)
            if self._learned is None:
                self._learned = rewards.build((("learned", 1.0),))
            entry["learned_reward"] = float(self._learned(result["images"], result["rows"])[0].mean())
            scalars["eval/learned_reward"] = entry["learned_reward"]
        text = (f"eval at step {step} (EMA weights, {len(self.test_prompts)} test prompts x {e.samples_per_prompt}, "
                f"ODE {e.num_steps} steps, cfg {e.cfg}):\n" + geneval.format_table(table))
        return Evaluation(entry, scalars, text)
