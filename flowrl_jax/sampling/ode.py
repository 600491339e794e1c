"""Deterministic Euler sampling of the probability-flow ODE with classifier-free guidance.

    x0 = sample_ode(velocity, x_T, sigmas, cond, null_cond, cfg)

`velocity(x [B, H, W, C], sigma [B], cond) -> v [B, H, W, C]`, `cond`/`null_cond` pytrees with
batch-leading leaves (the null condition is the empty prompt's embedding). CFG (SPEC.md §0):
`v = v_u + w (v_c - v_u)`, both evaluated in one call on the doubled batch. Step `i`:
`x <- x + v (sigma_{i+1} - sigma_i)` under a `lax.scan`.
"""
from typing import Any, Callable

import jax
import jax.numpy as jnp


def guided_velocity(velocity: Callable, x, sigma, cond: Any, null_cond: Any, cfg: float):
    """`v_u + cfg (v_c - v_u)`; cfg == 1 skips the unconditional pass."""
    b = x.shape[0]
    sigma = jnp.broadcast_to(sigma, (b,))
    if cfg == 1.0:
        return velocity(x, sigma, cond)
    both = jax.tree_util.tree_map(lambda c, u: jnp.concatenate([c, u]), cond, null_cond)
    v = velocity(jnp.concatenate([x, x]), jnp.concatenate([sigma, sigma]), both)
    v_c, v_u = v[:b], v[b:]
    return v_u + cfg * (v_c - v_u)


def sample_ode(velocity: Callable, x_T, sigmas, cond: Any, null_cond: Any, cfg: float = 1.0):
    """Euler ODE from x_T [B, H, W, C] at sigmas[0] to sigmas[-1]; returns the final sample."""

    def step(x, pair):
        sigma, sigma_next = pair
        v = guided_velocity(velocity, x, sigma, cond, null_cond, cfg)
        return x + v * (sigma_next - sigma), None

    x, _ = jax.lax.scan(step, x_T, (sigmas[:-1], sigmas[1:]))
    return x
