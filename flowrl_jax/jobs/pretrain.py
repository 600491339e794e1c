"""The `pretrain` job: rectified-flow pretraining of the shapes world's base model (DiT + text encoder).

    python -m flowrl_jax.main --config configs/pretrain_shapes.py --workdir workdirs/pretrain

Flow matching (docs/math.md §0): `x_t = (1 - t) x0 + t eps`, target `eps - x0`, t logit-normal
(`sigmoid(N(m, s))`), MSE. Scenes are rendered on the fly from `train.jsonl` prompts, categories
drawn uniformly (train holds 3 to 54 prompts per category), a host thread rendering the next batch
while the device trains, 10% of captions are dropped to the empty
prompt (the CFG null condition). AdamW with warmup + cosine decay, global-norm clipping, an EMA of
the params. The workdir holds `model.json`, `tokenizer/`, `checkpoints/` (orbax, keep-N; a rerun
resumes from the latest), `metrics.jsonl`, TensorBoard events and `samples_<step>.png` grids.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from flowrl_jax import metrics, parallel
from flowrl_jax.worlds.shapes import geneval
from flowrl_jax.checkpoint import Checkpointer
from flowrl_jax.config_lib import ConfigError
from flowrl_jax.data import shapes
from flowrl_jax.worlds.shapes.pipeline import Pipeline, build_pipeline, init_params, model_description


def make_optimizer(cfg) -> optax.GradientTransformation:
    lr = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup_steps, max(cfg.steps, cfg.warmup_steps + 1), end_value=0.1 * cfg.lr)
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), optax.adamw(lr, b2=0.99, weight_decay=cfg.weight_decay))


def flow_matching_loss(pipe: Pipeline, params, batch, rng, t_mean: float, t_std: float):
    """MSE between v(x_t, t) and `eps - x0` for `x_t = (1 - t) x0 + t eps` (docs/math.md §0)."""
    x0 = batch["images"]
    k_t, k_eps = jax.random.split(rng)
    t = jax.nn.sigmoid(t_mean + t_std * jax.random.normal(k_t, (x0.shape[0],)))
    eps = jax.random.normal(k_eps, x0.shape)
    x_t = (1 - t)[:, None, None, None] * x0 + t[:, None, None, None] * eps
    cond = pipe.encode(params["text"], batch["ids"], batch["mask"])
    v = pipe.dit.apply({"params": params["dit"]}, x_t, t, *cond)
    return jnp.mean(jnp.square(v - (eps - x0)))


def make_train_step(pipe: Pipeline, optimizer, cfg, base_rng):
    def train_step(state, batch):
        rng = jax.random.fold_in(base_rng, state["step"])
        loss, grads = jax.value_and_grad(lambda p: flow_matching_loss(pipe, p, batch, rng, cfg.t_logit_mean, cfg.t_logit_std))(state["params"])
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        step = state["step"] + 1
        decay = jnp.minimum(cfg.ema_decay, (1.0 + step) / (10.0 + step))
        ema = jax.tree_util.tree_map(lambda e, p: decay * e + (1 - decay) * p, state["ema"], params)
        stats = {"loss": loss, "grad_norm": optax.tree.norm(grads), "param_norm": optax.tree.norm(params)}
        return {"step": step, "params": params, "ema": ema, "opt_state": opt_state}, stats

    return train_step


class SceneStream:
    """Host batches `{"images" [B,H,W,3], "ids" [B,L], "mask" [B,L]}` for step s, reproducible from
    (seed, s); one background thread renders the next while the device trains."""

    def __init__(self, pipe: Pipeline, prompts: list[dict], batch_size: int, size: int, dropout: float, seed: int):
        self.pipe, self.prompts, self.batch_size, self.size, self.dropout, self.seed = pipe, prompts, batch_size, size, dropout, seed
        self.by_category = {c: [p for p in prompts if p["category"] == c] for c in shapes.CATEGORIES}
        self.by_category = {c: ps for c, ps in self.by_category.items() if ps}
        self.pool = concurrent.futures.ThreadPoolExecutor(1)
        self.pending = {}

    def make(self, step: int) -> dict:
        rng = np.random.default_rng([self.seed, step])
        categories = rng.choice(list(self.by_category), size=self.batch_size)  # balanced over categories
        picks = [self.by_category[c][rng.integers(len(self.by_category[c]))] for c in categories]
        images = shapes.render_batch([p["spec"] for p in picks], rng, self.size)
        texts = ["" if rng.random() < self.dropout else p["prompt"] for p in picks]
        ids, mask = self.pipe.tokenize(texts)
        return {"images": images.astype(np.float32), "ids": ids, "mask": mask}

    def get(self, step: int) -> dict:
        future = self.pending.pop(step, None) or self.pool.submit(self.make, step)
        self.pending[step + 1] = self.pool.submit(self.make, step + 1)
        return future.result()


def eval_prompts(per_category: int) -> list[dict]:
    """The first `per_category` test prompts of every category (a fixed, balanced subset)."""
    test = shapes.load_prompts("test")
    return [p for c in shapes.CATEGORIES for p in [q for q in test if q["category"] == c][:per_category]]


def run(config, workdir: str | None) -> dict:
    if not workdir:
        raise ConfigError("the pretrain job needs --workdir (checkpoints, metrics and samples go there)")
    cfg = config.pretrain
    parallel.maybe_initialize_distributed(config.distributed)
    mesh = parallel.make_mesh(config.mesh)
    pipe = build_pipeline(config)
    if cfg.batch_size % jax.device_count():
        raise ConfigError(f"pretrain.batch_size={cfg.batch_size} must be divisible by the {jax.device_count()} devices")
    os.makedirs(workdir, exist_ok=True)
    pipe.tokenizer.save_pretrained(os.path.join(workdir, "tokenizer"))
    with open(os.path.join(workdir, "model.json"), "w") as f:
        json.dump(model_description(config), f, indent=2)

    rng = jax.random.PRNGKey(config.seed)
    optimizer = make_optimizer(cfg)

    def init_state(r):
        params = init_params(pipe, r)
        return {"step": jnp.zeros((), jnp.int32), "params": params, "ema": params, "opt_state": optimizer.init(params)}

    state, shardings = parallel.init_sharded(init_state, rng, mesh, config.partition_rules, config.min_fsdp_size)
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), cfg.keep_checkpoints)
    restored, _, skipped = ckpt.restore_latest(state)
    for step, reason in skipped:
        print(f"checkpoint step {step} in {ckpt.directory} is damaged ({reason}); resuming from an older step")
    if restored is not None:
        state = restored
        print(f"resumed from step {int(state['step'])} in {ckpt.directory}")

    data = parallel.batch_sharding(mesh)
    step_fn = jax.jit(make_train_step(pipe, optimizer, cfg, jax.random.fold_in(rng, 1)), in_shardings=(shardings, data),
                      out_shardings=(shardings, None), donate_argnums=0)
    stream = SceneStream(pipe, shapes.load_prompts("train"), cfg.batch_size, pipe.dit.sample_size, cfg.caption_dropout, config.seed)
    sampler = geneval.make_sampler(pipe, cfg.sample_steps, cfg.sample_cfg, cfg.sample_shift)
    probe = eval_prompts(cfg.eval_per_category)
    writer = metrics.MetricWriter(workdir)
    start = int(state["step"])
    last = {}
    t_start = time.time()
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc="pretrain", dynamic_ncols=True)
    try:
        for step in bar:
            batch = parallel.shard_batch(stream.get(step), mesh)
            state, stats = step_fn(state, batch)
            done = step + 1
            if done % cfg.log_every == 0 or done == cfg.steps:
                stats = {k: float(v) for k, v in stats.items()}
                if not np.isfinite(stats["loss"]):
                    raise FloatingPointError(f"loss is {stats['loss']} at step {done}; the last good checkpoint in {ckpt.directory} is kept "
                                             "(lower pretrain.lr or raise pretrain.warmup_steps)")
                stats["steps_per_s"] = (done - start) / (time.time() - t_start)
                writer.scalars(done, stats)
                bar.set_postfix(loss=f"{stats['loss']:.4f}")
            if cfg.eval_every and (done % cfg.eval_every == 0 or done == cfg.steps):
                result = geneval.geneval(pipe, state["ema"], probe, jax.random.PRNGKey(0), 1, cfg.eval_batch_size, sampler=sampler)
                last = result["table"]
                writer.scalars(done, {f"eval/{k}/{m}": v[m] for k, v in last.items() for m in ("strict", "score")})
                geneval.category_grid(result, os.path.join(workdir, f"samples_{done:06d}.png"))
                bar.write(f"step {done}: eval strict {last['overall']['strict']:.3f} score {last['overall']['score']:.3f}")
            if done % cfg.checkpoint_every == 0 or done == cfg.steps:
                ckpt.save(done, state, {"step": done, "eval": last})
    finally:  # an interrupted run keeps every checkpoint it started writing
        ckpt.close()
        writer.close()
    return {"step": int(state["step"]), "eval": last}
