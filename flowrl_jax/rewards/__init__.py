"""Rewards by name: plain host functions `(images [B, H, W, 3] in [-1, 1] numpy, prompts list[dict]) -> r [B]`.

    reward_fn = build((("shapes_score", 1.0), ("shapes_strict", 0.5)))
    total, parts = reward_fn(images, prompts)        # weighted sum [B], and each named reward [B]

- `shapes_score`: the exact evaluator's partial-credit score (Flow-GRPO's GenEval reward), in [0, 1].
- `shapes_strict`: its 0/1 GenEval correctness.
- `learned`: the shipped learned reward (`shapes32_reward`, differentiable in the pixels).
- `jpeg_compressibility` / `jpeg_incompressibility`: DDPO's model-free rewards (`image.py`), for any world.
New rewards register in `REWARDS` (a factory returning the function, so heavy ones load lazily).
"""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from flowrl_jax.rewards import image, learned, shapes_eval


def _exact(field: str) -> Callable:
    def reward(images, prompts):
        return shapes_eval.evaluate(np.asarray(images), [p["spec"] for p in prompts])[field]
    return reward


def _learned() -> Callable:
    apply, params, tokenize = learned.reward_model()
    apply = jax.jit(apply)

    def reward(images, prompts):
        ids, mask = tokenize(prompts)
        return np.asarray(apply(params, jnp.asarray(images), jnp.asarray(ids), jnp.asarray(mask)))
    return reward


REWARDS: dict[str, Callable[[], Callable]] = {
    "shapes_score": lambda: _exact("score"),
    "shapes_strict": lambda: _exact("strict"),
    "learned": _learned,
    "jpeg_compressibility": lambda: image.jpeg_compressibility,
    "jpeg_incompressibility": lambda: image.jpeg_incompressibility,
}


def check(weighted: Sequence[tuple[str, float]]) -> None:
    """ValueError naming the unknown reward(s), without building any."""
    unknown = [str(n) for n, _ in weighted if str(n) not in REWARDS]
    if unknown or not weighted:
        raise ValueError(f"unknown reward(s) {unknown or 'none given'}; known rewards: {sorted(REWARDS)}")


def build(weighted: Sequence[tuple[str, float]]) -> Callable:
    """`((name, weight), ...)` -> `fn(images, prompts) -> (weighted sum [B] float32, {name: [B]})`."""
    check(weighted)
    weighted = [(str(n), float(w)) for n, w in weighted]
    fns = {n: REWARDS[n]() for n, _ in weighted}

    def reward(images, prompts):
        parts = {n: np.asarray(fns[n](images, prompts), np.float32) for n, _ in weighted}
        return sum(w * parts[n] for n, w in weighted).astype(np.float32), parts

    return reward
