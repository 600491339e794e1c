"""The shapes world's host rewards, built by name through the general registry (`rewards.REWARDS`).

    score = shapes_score()(images, prompt rows)     # [B] in [0, 1]; images numpy [B, H, W, 3] in [-1, 1]

- `shapes_score`: the exact evaluator's partial-credit score (Flow-GRPO's GenEval reward), in [0, 1].
- `shapes_strict`: its 0/1 GenEval correctness.
- `learned`: the shipped learned reward (`shapes32_reward`, differentiable in the pixels; `learned.py`).
Prompt rows carry the scene's `spec` (`data/shapes.py`).
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from flowrl_jax.worlds.shapes import evaluator, learned


def _exact(field: str) -> Callable:
    def reward(images, prompts):
        return evaluator.evaluate(np.asarray(images), [p["spec"] for p in prompts])[field]
    return reward


def shapes_score() -> Callable:
    return _exact("score")


def shapes_strict() -> Callable:
    return _exact("strict")


def learned_reward() -> Callable:
    apply, params, tokenize = learned.reward_model()
    apply = jax.jit(apply)

    def reward(images, prompts):
        ids, mask = tokenize(prompts)
        return np.asarray(apply(params, jnp.asarray(images), jnp.asarray(ids), jnp.asarray(mask)))
    return reward
