"""The `train_reward` job: fit the learned differentiable reward to the exact evaluator's score.

    python -m flowrl_jax.main --config configs/train_reward.py --workdir workdirs/reward

Data (`worlds/shapes/learned.make_reward_data`): rendered scenes for their own or another prompt,
corrupted scenes, and samples of the base model (`config.reward.base`) for train prompts at several
CFG scales (so sample quality varies), all labelled by `evaluator.evaluate`. Each batch is augmented
(`Augmenter`): images mirrored left-right, prompts swapped for another of the same category, and the
labels recomputed by the evaluator for what is shown; the loss is the score's BCE plus `count_weight` x
the MSE of the image side's object counts per (shape, color) (`LearnedReward(with_counts=True)`). Training sees one view
per example; the model is evaluated and shipped averaging each image with its mirror (`mirror_average`). Held out: base-model
samples with other seeds, for the *test* prompts (compositions never sampled for training) and
for the train prompts (the RL loop's distribution; the swapped prompts may be test prompts, as the
rendered scenes' are, but no held-out image is trained on), on which the Pearson correlations with the exact
score are reported (bar: >= 0.8). With `reward.export`, writes the shipped asset
`flowrl_jax/assets/<export>/` (params, tokenizer, model.json, 256 held-out samples of each kind in `heldout.npz`
for the CI test, MANIFEST.json).
"""
from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from flowrl_jax import checkpoint, metrics
from flowrl_jax.worlds.shapes import assets, geneval, learned, evaluator
from flowrl_jax.config_lib import ConfigError
from flowrl_jax.data import shapes


def generate(pipe, params, prompts: list[dict], n: int, samplers: dict, seed: int, batch_size: int = 96):
    """n base-model samples, prompts balanced over categories, the `samplers` ({cfg: jitted ODE
    sampler}) cycled per batch -> (images [n, H, W, 3], rows)."""
    rng = np.random.default_rng(seed)
    by_cat = {c: [p for p in prompts if p["category"] == c] for c in shapes.CATEGORIES}
    rows = [by_cat[c][rng.integers(len(by_cat[c]))] for c in rng.choice(shapes.CATEGORIES, size=n)]
    cfgs = sorted(samplers)
    batch_size = min(batch_size, n)  # a small request (the smoke test's 16) samples no padding rows
    images = []
    for i, start in enumerate(tqdm(range(0, n, batch_size), desc="base samples", leave=False)):
        chunk = rows[start : start + batch_size]
        ids, mask = pipe.tokenize([r["prompt"] for r in chunk] + [""] * (batch_size - len(chunk)))
        out = samplers[cfgs[i % len(cfgs)]](params, jnp.asarray(ids), jnp.asarray(mask), jax.random.PRNGKey(seed * 1000 + i))
        images.append(np.asarray(out)[: len(chunk)])
    return np.concatenate(images), rows


def cached_base_samples(pipe, params, prompts: list[dict], n: int, cfg, seed: int, path: str):
    """`generate(...)` cached in `path` (.npz, uint8 pixels): base-model sampling is most of the job's
    time, and a rerun with the same base, count, CFGs and seed reuses it. -> (images [n, H, W, 3], rows)."""
    key = json.dumps([str(cfg.base), int(n), list(cfg.cfgs), int(seed)])
    by_prompt = {p["prompt"]: p for p in prompts}
    if os.path.exists(path):
        cached = np.load(path)
        if str(cached["key"]) == key:
            return cached["images"].astype(np.float32) / 127.5 - 1.0, [by_prompt[str(q)] for q in cached["prompts"]]
    samplers = {c: geneval.make_sampler(pipe, 20, c, 1.0) for c in cfg.cfgs}
    images, rows = generate(pipe, params, prompts, n, samplers, seed=seed)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    np.savez_compressed(path, key=key, images=metrics.to_uint8(images), prompts=np.array([r["prompt"] for r in rows]))
    return metrics.to_uint8(images).astype(np.float32) / 127.5 - 1.0, rows  # the same quantized pixels as a rerun


def reward_loss(pred, target, kind: str = "bce"):
    """Mean loss of predicted scores `pred [B]` in (0, 1) against exact scores `target [B]` in [0, 1]:
    "mse", or "bce" (binary cross-entropy with soft targets; steeper near 0 and 1, where most scores are)."""
    if kind == "mse":
        return jnp.mean((pred - target) ** 2)
    p = jnp.clip(pred, 1e-6, 1 - 1e-6)
    return -jnp.mean(target * jnp.log(p) + (1 - target) * jnp.log1p(-p))


class Augmenter:
    """Training batches with labels computed on the fly by the exact evaluator (`learned.Detections`):
    each example is mirrored left-right with probability `flip`, and its prompt is swapped for a random
    prompt of the same category (any of `shapes.all_specs`) with probability `relabel`; the score is the
    evaluator's for the shown (image, prompt), the counts its detections per (shape, color)."""

    def __init__(self, data: dict, tokenize, relabel: float, flip: float):
        self.data, self.relabel, self.flip = data, relabel, flip
        self.detections = data["detections"]
        self.ids, self.mask = tokenize(data["prompts"])
        self.universe = {c: shapes.all_specs(c) for c in shapes.CATEGORIES}
        self.universe_tokens = {c: tokenize([shapes.format_prompt(q) for q in specs]) for c, specs in self.universe.items()}

    def batch(self, idx: np.ndarray, rng: np.random.Generator) -> tuple[dict, list[dict]]:
        """-> ({images [B, H, W, 3], ids, mask [B, L], score [B], counts [B, S + 1, K]}, the B specs shown)
        for examples `idx`."""
        n = len(idx)
        flip = rng.random(n) < self.flip
        images = self.data["images"][idx]
        images[flip] = images[flip, :, ::-1]
        specs = [self.data["specs"][i] for i in idx]
        ids, mask = self.ids[idx], self.mask[idx]
        for j in np.flatnonzero(rng.random(n) < self.relabel):
            cat = specs[j]["category"]
            pick = rng.integers(len(self.universe[cat]))
            specs[j] = self.universe[cat][pick]
            ids[j], mask[j] = self.universe_tokens[cat][0][pick], self.universe_tokens[cat][1][pick]
        objects = self.detections.batch(idx, flip)
        _, score = evaluator.score_objects(objects, specs)
        return {"images": images, "ids": ids, "mask": mask, "score": score, "counts": learned.object_counts(objects, n)}, specs


def pearson(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.corrcoef(a, b)[0, 1])


def run(config, workdir: str | None) -> dict:
    if not workdir:
        raise ConfigError("the train_reward job needs --workdir")
    cfg = config.reward
    pipe, base_params, info = assets.load_pipeline(cfg.base)
    train, test = shapes.load_prompts("train"), shapes.load_prompts("test")
    rng = np.random.default_rng(config.seed)

    def samples(name, prompts, n, seed):
        return cached_base_samples(pipe, base_params, prompts, n, cfg, seed, os.path.join(workdir, f"base_samples_{name}.npz"))

    gen_train = samples("train", train, cfg.generated_train, config.seed + 1)
    data = learned.make_reward_data(train + test, cfg.rendered, rng, pipe.dit.sample_size, generated=gen_train)
    # held out: new samples for the test prompts (unseen compositions) and, with other seeds, for train prompts
    held = learned.make_reward_data(test, 0, rng, generated=samples("test", test, cfg.generated_test, config.seed + 2))
    held_train = learned.make_reward_data(train, 0, rng, generated=samples("heldout_train", train, cfg.generated_test, config.seed + 3))
    augment = Augmenter(data, pipe.tokenize, cfg.relabel_fraction, cfg.flip_fraction)
    held_ids, held_mask = pipe.tokenize(held["prompts"])
    held_train_ids, held_train_mask = pipe.tokenize(held_train["prompts"])

    mirror_ids = tuple(pipe.tokenizer.convert_tokens_to_ids(["left", "right"])) if cfg.mirror_average else None
    model = learned.LearnedReward(vocab_size=len(pipe.tokenizer), width=cfg.width, heads=cfg.heads, max_len=pipe.text.max_len,
                                  palette_features=cfg.palette_features, mirror_ids=mirror_ids)
    with_counts = cfg.count_weight > 0
    init = jax.jit(model.init, static_argnums=4)  # one program, not op-by-op dispatch (~25 s on 2 cores)
    params = init(jax.random.PRNGKey(config.seed), data["images"][:2], augment.ids[:2], augment.mask[:2], with_counts)["params"]
    warmup = min(200, cfg.steps // 4)
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, cfg.steps, end_value=0.05 * cfg.lr)
    opt = optax.adamw(schedule, weight_decay=1e-4)
    opt_state = opt.init(params)

    def loss_fn(p, batch):
        if not with_counts:
            return reward_loss(model.apply({"params": p}, batch["images"], batch["ids"], batch["mask"], mirror=False), batch["score"], cfg.loss)
        pred, counts = model.apply({"params": p}, batch["images"], batch["ids"], batch["mask"], True, mirror=False)
        return reward_loss(pred, batch["score"], cfg.loss) + cfg.count_weight * jnp.mean(jnp.square(counts - batch["counts"]))

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    predict = jax.jit(lambda p, *a, mirror=True: model.apply({"params": p}, *a, mirror=mirror), static_argnames="mirror")

    def predict_all(p, images, ids, mask, bs=512, mirror=True):
        """The score alone (as shipped: the mirror average where `mirror_average`), in chunks of `bs`."""
        return np.concatenate([np.asarray(predict(p, images[i : i + bs], ids[i : i + bs], mask[i : i + bs], mirror=mirror))
                               for i in range(0, len(images), bs)])

    writer = metrics.MetricWriter(workdir)
    n = len(data["score"])
    generated = np.flatnonzero(data["source"] == "generated")
    rendered = np.flatnonzero(data["source"] != "generated")
    n_gen = int(round(cfg.generated_fraction * cfg.batch_size)) if len(generated) else 0
    for i in (bar := tqdm(range(cfg.steps), desc="reward")):
        idx = np.concatenate([rng.choice(generated, n_gen), rng.choice(rendered, cfg.batch_size - n_gen)])
        params, opt_state, loss = step(params, opt_state, augment.batch(idx, rng)[0])
        if (i + 1) % 100 == 0:
            bar.set_postfix(loss=f"{float(loss):.4f}")
            writer.scalars(i + 1, {"reward/loss": float(loss)})
        if (i + 1) % 1000 == 0 or i + 1 == cfg.steps:
            r = pearson(predict_all(params, held["images"], held_ids, held_mask), held["score"])
            r_train = pearson(predict_all(params, held_train["images"], held_train_ids, held_train_mask), held_train["score"])
            writer.scalars(i + 1, {"reward/pearson_heldout": r, "reward/pearson_heldout_train_prompts": r_train})
            tqdm.write(f"step {i + 1}: held-out Pearson {r:.3f} (test prompts), {r_train:.3f} (train prompts, new samples)")

    pred_held = predict_all(params, held["images"], held_ids, held_mask)
    pred_held_train = predict_all(params, held_train["images"], held_train_ids, held_train_mask)
    result = {"pearson_heldout_base_samples": pearson(pred_held, held["score"]), "n_heldout": int(len(pred_held)),
              "pearson_heldout_base_samples_train_prompts": pearson(pred_held_train, held_train["score"]),
              "n_train": int(n), "train_sources": {s: int((data["source"] == s).sum()) for s in np.unique(data["source"])},
              "mse_heldout": float(np.mean((pred_held - held["score"]) ** 2)), "base": info["name"]}
    if mirror_ids is not None:  # what the mirror average adds: the same params, one view
        result["pearson_single_view"] = [pearson(predict_all(params, h["images"], i, m, mirror=False), h["score"])
                                         for h, i, m in ((held, held_ids, held_mask), (held_train, held_train_ids, held_train_mask))]
    writer.close()
    print(json.dumps(result, indent=2))
    with open(os.path.join(workdir, "reward_eval.json"), "w") as f:
        json.dump(result, f, indent=2)

    if cfg.export:
        folder = os.path.join(assets.ASSET_DIR, cfg.export)
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        with open(os.path.join(folder, "model.json"), "w") as f:
            json.dump({"reward": {"vocab_size": model.vocab_size, "width": model.width, "heads": model.heads, "max_len": model.max_len,
                                  "palette_features": model.palette_features, "mirror_ids": model.mirror_ids}}, f, indent=2)
        pipe.tokenizer.save_pretrained(os.path.join(folder, "tokenizer"))
        checkpoint.save_params(os.path.join(folder, "params"), params)
        keep = [np.random.default_rng(0).permutation(len(h["score"]))[:256] for h in (held, held_train)]
        np.savez_compressed(os.path.join(folder, "heldout.npz"),
                            images=metrics.to_uint8(np.concatenate([held["images"][keep[0]], held_train["images"][keep[1]]])),
                            prompts=np.array(held["prompts"])[keep[0]].tolist() + np.array(held_train["prompts"])[keep[1]].tolist(),
                            split=np.array(["test_prompts"] * len(keep[0]) + ["train_prompts"] * len(keep[1])))
        assets.write_manifest(folder, {"name": cfg.export, "config": cfg.to_dict(), **result})
        print(f"exported {folder}")
    return result
