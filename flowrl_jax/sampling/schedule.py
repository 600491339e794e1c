"""The shifted sigma schedule of diffusers' `FlowMatchEulerDiscreteScheduler(shift).set_timesteps(T)`.

docs/math.md §0: `sh(s) = shift s / (1 + (shift - 1) s)`, `s = linspace(1, sh(1/1000), T)`,
`sigma_i = sh(s_i)` for i < T and `sigma_T = 0`. (diffusers shifts the end point once when the
scheduler is built and again in set_timesteps; SD3.5 checkpoints were trained on those times.)
"""
import jax.numpy as jnp


def shift_sigma(s, shift: float):
    return shift * s / (1 + (shift - 1) * s)


def sigmas(num_steps: int, shift: float = 3.0) -> jnp.ndarray:
    """[T + 1] float32, from 1.0 down to 0.0; step i goes sigma_i -> sigma_{i+1}."""
    s = jnp.linspace(1.0, shift_sigma(1.0 / 1000, shift), num_steps)
    return jnp.concatenate([shift_sigma(s, shift), jnp.zeros((1,))]).astype(jnp.float32)
