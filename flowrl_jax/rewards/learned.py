"""The learned, differentiable reward of the shapes world: (image, prompt) -> predicted exact score.

    reward = LearnedReward(vocab_size)
    r = reward.apply({"params": p}, images [B, H, W, 3] in [-1, 1], ids [B, L], mask [B, L])   # [B] in [0, 1]

A small conv net turns the image into a feature map (8 x 8 cells at 32 x 32), a one-layer text
transformer encodes the prompt, the text tokens cross-attend to the cells, and an MLP on the
attended summary predicts the exact evaluator's partial-credit `score` (sigmoid output, MSE).
It is what the gradient-based methods (spatial credit, LeapAlign) differentiate: `jax.grad` of its
output w.r.t. the image is defined everywhere, unlike the evaluator's thresholds.

Training data (`make_reward_data`): scenes rendered for their own prompt, scenes rendered for
another prompt of any category, corrupted scenes (objects dropped or recoloured, blur, noise,
blank), and base-model samples, each labelled by `shapes_eval.evaluate` against the prompt.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from flowrl_jax.data import shapes
from flowrl_jax.rewards import shapes_eval


class LearnedReward(nn.Module):
    vocab_size: int
    width: int = 64
    heads: int = 4
    max_len: int = 10

    @nn.compact
    def __call__(self, images: jax.Array, ids: jax.Array, mask: jax.Array) -> jax.Array:
        w = self.width
        h = images
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
        return jax.nn.sigmoid(out[:, 0])


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
    Returns {"images" [M, H, W, 3], "prompts" [M] str, "score" [M], "source" [M] str}."""
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
    score = shapes_eval.evaluate(images, [r["spec"] for r in rows])["score"]
    return {"images": images, "prompts": [r["prompt"] for r in rows], "score": np.asarray(score, np.float32), "source": np.array(source)}
