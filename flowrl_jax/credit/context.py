"""What a credit scheme's host-side `prepare(ctx, options)` may use: the rollout and three tools.

    ctx.rollout                          # the iteration's Rollout (global arrays)
    ctx.rewards_of(images [B_l, M, H, W, C] numpy) -> [B, M]        # the run's reward, per image
    ctx.ode_completions(steps [m])       -> [B, m, H, W, C]          # ODE from the state before each step
    ctx.reward_gradient(images [B, H, W, C]) -> [B, H, W, C]         # d learned reward / d pixels

Rewards run on host for this process's rows (`ctx.local`) with this process's prompts and come back
as one global array; completions and gradients are jit-compiled on the global (sharded) batch. The
train job builds one Context per iteration (`train.Steps.context`).
"""
from __future__ import annotations

from typing import Callable

import jax
import numpy as np

from flowrl_jax import parallel


class Context:
    def __init__(self, rollout, prompts_local: list[dict], reward_fn: Callable, mesh, complete: Callable,
                 reward_gradient: Callable):
        self.rollout, self.prompts_local, self.mesh = rollout, prompts_local, mesh
        self._reward_fn, self._complete, self._reward_gradient = reward_fn, complete, reward_gradient

    def local(self, x: jax.Array) -> np.ndarray:
        return parallel.local_rows(x)

    def to_global(self, local: np.ndarray) -> jax.Array:
        return parallel.global_from_local(local, self.mesh)

    def rewards_of(self, images_local: np.ndarray) -> jax.Array:
        """The run's (weighted) reward of `M` images per local sample `[B_l, M, H, W, C]` -> global `[B, M]`."""
        b, m = images_local.shape[:2]
        prompts = [p for p in self.prompts_local for _ in range(m)]
        total, _ = self._reward_fn(images_local.reshape((b * m,) + images_local.shape[2:]), prompts)
        total = np.asarray(total, np.float32).reshape(b, m)
        if not np.all(np.isfinite(total)):
            raise FloatingPointError("a credit scheme's reward (of Tweedie estimates or ODE completions) is not finite")
        return self.to_global(total)

    def ode_completions(self, steps: np.ndarray) -> jax.Array:
        """`[B, m, H, W, C]`: for each step `t` in `steps`, the ODE sampler (same model, CFG) run from the
        rollout's state before step `t` down to sigma = 0."""
        return self._complete(self.rollout.states[:, np.asarray(steps)], np.asarray(steps, np.int32))

    def reward_gradient(self, images: jax.Array) -> jax.Array:
        """Gradient of the learned differentiable reward w.r.t. the pixels, for each sample's own prompt."""
        return self._reward_gradient(images, self.prompts_local)
