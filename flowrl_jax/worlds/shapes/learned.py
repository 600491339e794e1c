"""The learned, differentiable reward of the shapes world: (image, prompt) -> predicted exact score.

    reward = LearnedReward(vocab_size)
    r = reward.apply({"params": p}, images [B, H, W, 3] in [-1, 1], ids [B, L], mask [B, L])   # [B] in [0, 1]
    model, params, tokenizer, manifest = load("shapes32_reward")       # a shipped reward, manifest-checked
    apply, params, tokenize = reward_model()                           # what the RL loop differentiates

A small conv net turns the image into a feature map (8 x 8 cells at 32 x 32), a one-layer text
transformer encodes the prompt, the text tokens cross-attend to the cells, and an MLP on the
attended summary predicts the exact evaluator's partial-credit `score` (sigmoid output). A second head on
the image side alone (`with_counts`) predicts how many objects of each (shape, color) the evaluator detects,
an auxiliary target during training (`train_reward.py`). With `mirror_ids` the prediction is the mean over
the image and its left-right mirror shown with the mirrored prompt ("left" <-> "right"): a symmetry the exact
score has, so the average keeps it exactly and cancels the part of the single view's error that is not symmetric.
It is what the gradient-based methods (spatial credit, LeapAlign) differentiate: `jax.grad` of its
output w.r.t. the image is defined everywhere, unlike the evaluator's thresholds.

Training data (`make_reward_data`): scenes rendered for their own prompt, scenes rendered for
another prompt of any category, corrupted scenes (objects dropped or recoloured, blur, noise,
blank), and base-model samples, each labelled by the exact evaluator against the prompt.
`Detections` keeps the evaluator's detections per image so that training can mirror an image or
show it with another prompt and still label it exactly, without detecting again.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import json
import os

from transformers import PreTrainedTokenizerFast

from flowrl_jax import checkpoint
from flowrl_jax.worlds.shapes import assets, evaluator
from flowrl_jax.data import shapes
from flowrl_jax.models.text import tokenize


def palette_channels(images: jax.Array) -> jax.Array:
    """[B, H, W, 3] -> [B, H, W, 3 + 2K]: the image, and per palette color k the evaluator's step-1 quantities
    (`evaluator.segment`) in differentiable form: the coverage `a_k = clip(d . v_k / |v_k|^2, 0, 1)` and
    the off-hue residual `|d - a_k v_k|^2 / |d|^2`, `d = pixel - background`, `v_k = color k - background`."""
    bg = jnp.asarray(shapes.to_unit(shapes.BACKGROUND), jnp.float32)
    v = jnp.asarray(np.stack([shapes.to_unit(shapes.PALETTE[c]) for c in shapes.COLORS]), jnp.float32) - bg  # [K, 3]
    vv = (v * v).sum(1)
    d = jnp.clip(images, -1.0, 1.0) - bg
    proj = d @ v.T
    a = jnp.clip(proj / vv, 0.0, 1.0)
    dd = (d * d).sum(-1, keepdims=True)
    residual = (dd - 2 * a * proj + a * a * vv) / (dd + 1e-3)
    return jnp.concatenate([images, a, residual], axis=-1)


class LearnedReward(nn.Module):
    vocab_size: int
    width: int = 64
    heads: int = 4
    max_len: int = 10
    palette_features: bool = False  # feed `palette_channels(images)` instead of the bare pixels
    mirror_ids: tuple[int, int] | None = None  # token ids of ("left", "right"): average over the left-right mirror

    @nn.compact
    def __call__(self, images: jax.Array, ids: jax.Array, mask: jax.Array, with_counts: bool = False, mirror: bool = True):
        """-> score [B] in (0, 1); with `with_counts` also (score, counts [B, S + 1, K]): the image side's
        estimate of how many objects of each (shape or none, color) the evaluator detects (`object_counts`).

        With `mirror_ids` (and `mirror`), both outputs are the mean over (image, prompt) and (the image
        mirrored left-right, the prompt with "left" and "right" swapped): the exact score is invariant
        under that pair of mirrors (`shapes.relation_holds`), so the average is too, exactly."""
        num = images.shape[0]
        if self.mirror_ids is not None and mirror:
            left, right = self.mirror_ids
            swapped = jnp.where(ids == left, right, jnp.where(ids == right, left, ids))
            images, ids, mask = (jnp.concatenate(pair) for pair in ((images, images[:, :, ::-1]), (ids, swapped), (mask, mask)))
        w = self.width
        h = palette_channels(images) if self.palette_features else images
        for i, features in enumerate((32, 64, w)):
            h = nn.gelu(nn.Conv(features, (3, 3), name=f"conv_{i}a")(h))
            h = nn.gelu(nn.Conv(features, (3, 3), strides=(2, 2) if i < 2 else (1, 1), name=f"conv_{i}b")(h))
        b, gh, gw, _ = h.shape
        pos = self.param("cell_pos", nn.initializers.normal(0.02), (gh * gw, w))
        cells = nn.LayerNorm(name="ln_cells")(h.reshape(b, gh * gw, w) + pos[None])

        t = nn.Embed(self.vocab_size, w, name="embed")(ids) + self.param("tok_pos", nn.initializers.normal(0.02), (self.max_len, w))[None, : ids.shape[1]]
        t = t + nn.MultiHeadDotProductAttention(self.heads, name="self_attn")(t, t, mask=nn.make_attention_mask(mask, mask))
        t = nn.LayerNorm(name="ln_text")(t)
        for i in range(2):  # text queries read the image, twice
            t = t + nn.MultiHeadDotProductAttention(self.heads, name=f"cross_attn_{i}")(t, cells)
            t = t + nn.Dense(w, name=f"mlp_out_{i}")(nn.gelu(nn.Dense(2 * w, name=f"mlp_in_{i}")(nn.LayerNorm(name=f"ln_mlp_{i}")(t))))
        m = mask[..., None].astype(t.dtype)
        summary = jnp.concatenate([(t * m).sum(1) / m.sum(1), t[:, 0]], axis=-1)
        out = nn.Dense(1, name="head")(nn.gelu(nn.Dense(w, name="head_hidden")(summary)))
        views = lambda x: x.reshape(b // num, num, *x.shape[1:]).mean(0)  # noqa: E731  (1 or 2 views per image)
        score = views(jax.nn.sigmoid(out[:, 0]))
        if not with_counts:
            return score
        s, k = len(shapes.SHAPES) + 1, len(shapes.COLORS)
        counts = nn.Dense(s * k, name="count_head")(nn.gelu(nn.Dense(w, name="count_hidden")(cells.mean(1))))
        return score, views(counts.reshape(b, s, k))


def object_counts(objects: dict, num_images: int, cap: int = 4) -> np.ndarray:
    """[B, S + 1, K] float32: detected objects per (shape, color), shape index S = none of the shapes
    (clutter), capped at `cap`; `objects` as `evaluator.detect` returns them."""
    s, k = len(shapes.SHAPES), len(shapes.COLORS)
    hist = np.zeros((num_images, s + 1, k), np.float32)
    shape = np.where(np.asarray(objects["shape"]) >= 0, objects["shape"], s)
    np.add.at(hist, (np.asarray(objects["image"]), shape, np.asarray(objects["color"])), 1)
    return np.minimum(hist, cap)


class Detections:
    """The exact evaluator's detections of a fixed image set, indexed by image, so that any image can be
    scored against any prompt, mirrored left-right, without detecting again (`batch`)."""

    def __init__(self, images: np.ndarray):
        objects = evaluator.detect(images)
        order = np.argsort(objects["image"], kind="stable")
        self.objects = {key: np.asarray(v)[order] for key, v in objects.items()}
        self.starts = np.searchsorted(self.objects["image"], np.arange(len(images) + 1))
        self.width = images.shape[2]

    def batch(self, idx: np.ndarray, flip: np.ndarray) -> dict:
        """The objects of images `idx [B]` renumbered 0..B-1, `cx` mirrored where `flip [B]`. A left-right
        mirror changes no shape feature (the moments used are even in x or vertical only), only `cx`."""
        rows = [np.arange(self.starts[i], self.starts[i + 1]) for i in idx]
        take = np.concatenate(rows) if rows else np.zeros(0, np.int64)
        out = {key: v[take] for key, v in self.objects.items()}
        out["image"] = np.repeat(np.arange(len(idx)), [len(r) for r in rows])
        out["cx"] = np.where(np.repeat(flip, [len(r) for r in rows]), self.width - out["cx"], out["cx"])
        return out


def corrupt(image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One random corruption of a rendered scene: blur, noise, a blank or partly blanked canvas."""
    kind = rng.integers(4)
    out = image.copy()
    if kind == 0:  # blur
        k = np.ones(3) / 3
        for axis in (0, 1):
            out = np.apply_along_axis(lambda v: np.convolve(v, k, mode="same"), axis, out)
    elif kind == 1:  # noise
        out = np.clip(out + rng.normal(0, rng.uniform(0.1, 0.6), out.shape), -1, 1)
    elif kind == 2:  # blank half (drops the objects there)
        bg = np.asarray(shapes.to_unit(shapes.BACKGROUND), np.float32)
        half = out.shape[0] // 2
        if rng.random() < 0.5:
            out[:half] = bg
        else:
            out[:, half:] = bg
    else:  # blank
        out[:] = np.asarray(shapes.to_unit(shapes.BACKGROUND), np.float32)
    return out.astype(np.float32)


def make_reward_data(prompts: list[dict], n: int, rng: np.random.Generator, size: int = 32,
                     generated: tuple[np.ndarray, list[dict]] | None = None) -> dict:
    """`n` rendered examples (40% own prompt, 35% another prompt, 25% corrupted), plus the
    `generated` (images, prompt rows) pairs if given, labelled with the exact evaluator's score.
    Returns {"images" [M, H, W, 3], "prompts" [M] str, "specs" [M], "score" [M], "source" [M] str,
    "detections" (`Detections` of the images, for relabelling without detecting again)}."""
    images, rows, source = [], [], []
    for _ in range(n):
        target = prompts[rng.integers(len(prompts))]
        u = rng.random()
        shown = target if u < 0.4 else prompts[rng.integers(len(prompts))]
        image, _ = shapes.sample_scene(shown["spec"], rng, size)
        if u >= 0.75:
            image = corrupt(image, rng)
        images.append(image)
        rows.append(target)
        source.append("own" if u < 0.4 else "other" if u < 0.75 else "corrupt")
    images = np.stack(images).astype(np.float32) if images else np.zeros((0, size, size, 3), np.float32)
    if generated is not None:
        images = np.concatenate([images, generated[0].astype(np.float32)])
        rows = rows + list(generated[1])
        source = source + ["generated"] * len(generated[1])
    detections = Detections(images)
    _, score = evaluator.score_objects(detections.objects, [r["spec"] for r in rows])
    return {"images": images, "prompts": [r["prompt"] for r in rows], "specs": [r["spec"] for r in rows],
            "score": np.asarray(score, np.float32), "source": np.array(source), "detections": detections}


def load(name: str = "shapes32_reward"):
    """-> (LearnedReward, params, tokenizer, manifest) of a shipped learned reward (`assets/<name>/`)."""
    folder = os.path.join(assets.ASSET_DIR, name)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"no shipped reward {name!r} in {assets.ASSET_DIR}; train one with configs/train_reward.py")
    manifest = assets.verify(folder)
    with open(os.path.join(folder, "model.json")) as f:
        fields = json.load(f)["reward"]
    if fields.get("mirror_ids") is not None:
        fields["mirror_ids"] = tuple(fields["mirror_ids"])  # JSON has lists; module fields stay hashable
    model = LearnedReward(**fields)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(os.path.join(folder, "tokenizer"))
    return model, checkpoint.load_params(os.path.join(folder, "params")), tokenizer, manifest


def reward_model(name: str = "shapes32_reward"):
    """(apply(params, images, ids, mask) -> [B], params, tokenize(prompt rows) -> (ids, mask)) of a shipped reward."""
    model, params, tokenizer, _ = load(name)
    return (lambda p, x, i, m: model.apply({"params": p}, x, i, m)), params, \
        (lambda rows: tokenize(tokenizer, [r["prompt"] for r in rows], model.max_len))
