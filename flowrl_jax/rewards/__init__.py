"""Rewards by name: plain host functions `(images [B, H, W, 3] in [-1, 1] numpy, prompts list[dict]) -> r [B]`.

    reward_fn = build((("shapes_score", 1.0), ("shapes_strict", 0.5)))
    total, parts = reward_fn(images, prompts)        # weighted sum [B], and each named reward [B]

- `shapes_score`: the exact evaluator's partial-credit score (Flow-GRPO's GenEval reward), in [0, 1].
- `shapes_strict`: its 0/1 GenEval correctness.
- `learned`: the shipped learned reward (`shapes32_reward`, differentiable in the pixels).
New rewards register in `REWARDS` (a factory returning the function, so heavy ones load lazily).
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from flowrl_jax.rewards import shapes_eval


def _exact(field: str) -> Callable:
    def reward(images, prompts):
        return shapes_eval.evaluate(np.asarray(images), [p["spec"] for p in prompts])[field]
    return reward


def learned_model(name: str = "shapes32_reward"):
    """(apply(params, images, ids, mask) -> [B], params, tokenize(prompt rows) -> (ids, mask)) of a shipped reward."""
    from flowrl_jax import assets
    from flowrl_jax.models.text import tokenize

    model, params, tokenizer, _ = assets.load_reward(name)
    return (lambda p, x, i, m: model.apply({"params": p}, x, i, m)), params, \
        (lambda rows: tokenize(tokenizer, [r["prompt"] for r in rows], model.max_len))


def _learned() -> Callable:
    import jax
    import jax.numpy as jnp

    apply, params, tokenize = learned_model()
    apply = jax.jit(apply)

    def reward(images, prompts):
        ids, mask = tokenize(prompts)
        return np.asarray(apply(params, jnp.asarray(images), jnp.asarray(ids), jnp.asarray(mask)))
    return reward


def learned_gradient(mesh=None) -> Callable:
    """`(images [B, H, W, C] jax, prompt rows) -> d R_learned / d images [B, H, W, C]` (jit-compiled). With a
    `mesh`, the reward's params are replicated on it and the prompt tokens sharded like the images' batch."""
    import jax

    apply, params, tokenize = learned_model()
    place = lambda x: x  # noqa: E731
    if mesh is not None:
        from flowrl_jax import parallel

        params = jax.device_put(params, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
        place = lambda x: parallel.shard_batch(x, mesh)  # noqa: E731
    grad = jax.jit(jax.grad(lambda x, p, i, m: apply(p, x, i, m).sum()))

    def gradient(images, prompts):
        ids, mask = place(tokenize(prompts))
        return grad(images, params, ids, mask)
    return gradient


REWARDS: dict[str, Callable[[], Callable]] = {
    "shapes_score": lambda: _exact("score"),
    "shapes_strict": lambda: _exact("strict"),
    "learned": _learned,
}


def build(weighted: Sequence[tuple[str, float]]) -> Callable:
    """`((name, weight), ...)` -> `fn(images, prompts) -> (weighted sum [B] float32, {name: [B]})`."""
    weighted = [(str(n), float(w)) for n, w in weighted]
    unknown = [n for n, _ in weighted if n not in REWARDS]
    if unknown or not weighted:
        raise ValueError(f"unknown reward(s) {unknown or 'none given'}; known rewards: {sorted(REWARDS)}")
    fns = {n: REWARDS[n]() for n, _ in weighted}

    def reward(images, prompts):
        parts = {n: np.asarray(fns[n](images, prompts), np.float32) for n, _ in weighted}
        return sum(w * parts[n] for n, w in weighted).astype(np.float32), parts

    return reward
