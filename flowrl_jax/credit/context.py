"""What a credit scheme's host-side `prepare(ctx, options)` may use: the rollout and the world's tools.

    ctx.rollout, ctx.schedule            # the iteration's Rollout (global arrays) and its Schedule
    ctx.rewards_of(x [B, M, H, W, C])    -> [B, M]                 # the run's reward of each decoded state
    ctx.ode_completions(steps [m])       -> [B, m, H, W, C]         # ODE from the state before each step
    ctx.reward_gradient(x [B, H, W, C])  -> [B, H, W, C]            # d reward model / d x
    ctx.decode(x), ctx.local(x), ctx.to_global(local), ctx.prompts_local

`x` are the DiT's states (pixels in the shapes world, latents in a latent world: `decode` maps them to
images). Rewards run on host for this process's rows with this process's prompts and come back as one
global array; completions and gradients are jit-compiled on the global (sharded) batch. The train loop
builds one Context per iteration (`rl/programs.py` `credit_context`).
"""
from __future__ import annotations

from typing import Callable

import jax
import numpy as np

from flowrl_jax import parallel


class Context:
    def __init__(self, rollout, schedule, prompts_local: list[dict], reward_fn: Callable, mesh, complete: Callable,
                 reward_gradient: Callable | None, decode: Callable):
        self.rollout, self.schedule, self.prompts_local, self.mesh, self.decode = rollout, schedule, prompts_local, mesh, decode
        self._reward_fn, self._complete, self._reward_gradient = reward_fn, complete, reward_gradient

    def local(self, x: jax.Array) -> np.ndarray:
        return parallel.local_rows(x)

    def to_global(self, local: np.ndarray) -> jax.Array:
        return parallel.global_from_local(local, self.mesh)

    def rewards_of(self, x: jax.Array) -> jax.Array:
        """The run's (weighted) reward of `M` decoded states per sample, global `[B, M, ...]` -> global `[B, M]`."""
        images = self.local(self.decode(x))
        b, m = images.shape[:2]
        prompts = [p for p in self.prompts_local for _ in range(m)]
        total, _ = self._reward_fn(images.reshape((b * m,) + images.shape[2:]), prompts)
        total = np.asarray(total, np.float32).reshape(b, m)
        if not np.all(np.isfinite(total)):
            raise FloatingPointError("a credit scheme's reward (of Tweedie estimates or ODE completions) is not finite")
        return self.to_global(total)

    def ode_completions(self, steps: np.ndarray) -> jax.Array:
        """`[B, m, H, W, C]`: for each step `t` in `steps`, the ODE sampler (same model, CFG) run from the
        rollout's state before step `t` down to sigma = 0."""
        return self._complete(self.rollout.states[:, np.asarray(steps)], np.asarray(steps, np.int32))

    def reward_gradient(self, x: jax.Array) -> jax.Array:
        """Gradient of the world's differentiable reward model w.r.t. `x`, for each sample's own prompt."""
        return self._reward_gradient(x, self.prompts_local)
