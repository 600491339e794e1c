"""The shifted sigma schedule of diffusers' `FlowMatchEulerDiscreteScheduler(shift).set_timesteps(T)`.

docs/math.md §0: `sh(s) = shift s / (1 + (shift - 1) s)`, `s = linspace(1, sh(1/1000), T)`,
`sigma_i = sh(s_i)` for i < T and `sigma_T = 0`. (diffusers shifts the end point once when the
scheduler is built and again in set_timesteps; SD3.5 checkpoints were trained on those times.)

FLUX.1 (`FluxPipeline`) shifts by the image's size instead: `mu` grows linearly with the packed token count (0.5 at
256 tokens to 1.15 at 4,096), and `s = linspace(1, 1/T, T)` is shifted by `exp(mu)` (the scheduler's exponential
time shift `e^mu / (e^mu + 1/s - 1)` is `sh` with shift `e^mu`).
"""
import math

import jax.numpy as jnp
import numpy as np


def shift_sigma(s, shift: float):
    return shift * s / (1 + (shift - 1) * s)


def unshift_sigma(sigma, shift: float):
    """The inverse of `shift_sigma`: the unshifted time `t` with `shift_sigma(t, shift) = sigma`."""
    return sigma / (shift - (shift - 1) * sigma)


GRIDS = ("sd3", "flux")


def sigmas(num_steps: int, shift: float = 3.0, grid: str = "sd3") -> jnp.ndarray:
    """[T + 1] float32, from 1.0 down to 0.0; step i goes sigma_i -> sigma_{i+1}. `grid`: the base times the shift is
    applied to, "sd3" (`FlowMatchEulerDiscreteScheduler.set_timesteps(T)`) or "flux" (`FluxPipeline`'s `linspace(1, 1/T,
    T)`, with `shift` = e^mu: `flux_sigmas`)."""
    if grid == "flux":
        return flux_sigmas(num_steps, math.log(shift))
    if grid != "sd3":
        raise ValueError(f"sampler.grid={grid!r}: choose one of {', '.join(GRIDS)}")
    s = jnp.linspace(1.0, shift_sigma(1.0 / 1000, shift), num_steps)
    return jnp.concatenate([shift_sigma(s, shift), jnp.zeros((1,))]).astype(jnp.float32)


def flux_shift(resolution: int, vae_factor: int = 8) -> float:
    """e^mu of FLUX.1's dynamic shift for square `resolution`-pixel images: the `shift` of the "flux" grid that equals
    `FluxPipeline`'s schedule ((resolution / vae_factor / 2)^2 packed tokens)."""
    return math.exp(flux_mu((resolution // (2 * vae_factor)) ** 2))


def flux_mu(image_tokens: int, base_tokens: int = 256, max_tokens: int = 4096, base_shift: float = 0.5,
            max_shift: float = 1.15) -> float:
    """FLUX's dynamic shift `mu` for `image_tokens` packed tokens (`FluxPipeline.calculate_shift`; the defaults are
    FLUX.1's scheduler config)."""
    slope = (max_shift - base_shift) / (max_tokens - base_tokens)
    return image_tokens * slope + base_shift - slope * base_tokens


def flux_sigmas(num_steps: int, mu: float) -> jnp.ndarray:
    """[T + 1] float32: `linspace(1, 1/T, T)` shifted by `exp(mu)` (in float64, as the scheduler), then 0."""
    s = np.linspace(1.0, 1.0 / num_steps, num_steps)
    return jnp.asarray(np.concatenate([shift_sigma(s, math.exp(mu)), [0.0]]), jnp.float32)
