"""Gaussian transition kernels of the reverse process (docs/math.md §1) and their per-token log-probs.

    mean, std, v = transition("sde", velocity, x, sigma, sigma_next, a, sigma_1)
    l = token_logprob(x_next, mean, std, patch_size)         # [B, N]; per-sample = l.mean(-1)

`velocity(x [B, H, W, C], sigma [B]) -> v` is the (guided) DiT velocity at noise level `sigma`
(docs/math.md §0: t = 1 noise, t = 0 data; step `sigma -> sigma_next`, `dt = sigma_next - sigma < 0`).
`sigma`, `sigma_next` and the noise level `a` are per sample `[B]` (a rollout step broadcasts a
scalar; a training minibatch mixes steps). Every kernel returns `x' ~ N(mean, std^2 I)` with
`mean [B, H, W, C]` and a per-sample `std [B]` (0 for a deterministic step). `v` is the velocity at
`x` (the Tweedie estimate is `x - sigma v`).

- `ode`: Euler, `mean = x + v dt`, `std = 0`.
- `sde` (Flow-GRPO) and `cps` (Flow-CPS) are affine in `(x, v)`: `mean = c_x x + c_v v`, with the
  exact coefficients of `affine_coefficients` (`c_v = d mean / d v` is the path-variance coefficient of
  docs/math.md §4). With `a = 0` both are Euler.
- `lc` (LC-GRPO): Euler to `y`, then one Langevin step toward the marginal at `sigma_next` using a
  second velocity call at `y`; Euler where `a sigma_next = 0` (the last step, and outside an SDE window).
"""
from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp

from flowrl_jax.models.mmdit import patchify

KINDS = ("ode", "sde", "cps", "lc")
LOGPROB_FORMS = ("gaussian", "cps_compat")


def column(s, x):
    """Per-sample [B] (or scalar) -> broadcastable against x [B, ...]."""
    s = jnp.asarray(s, x.dtype)
    return s.reshape(s.shape + (1,) * (x.ndim - s.ndim)) if s.ndim else s


def affine_coefficients(kind: str, sigma, sigma_next, a, sigma_1):
    """(c_x, c_v, std), each [B], of the affine kernels: `mean = c_x x + c_v v`, `x' = mean + std z`.

    sde (docs/math.md §1): `g = a sqrt(sigma / (1 - sigma_safe))` (sigma_safe = sigma_1 at sigma = 1),
    `c_x = 1 + g^2 dt / (2 sigma)`, `c_v = (1 + g^2 (1 - sigma) / (2 sigma)) dt`, `std = g sqrt(-dt)`.
    cps: `std = sigma' sin(a pi / 2)`, `mean = x0_hat (1 - sigma') + eps_hat sqrt(sigma'^2 - std^2)` with
    `x0_hat = x - sigma v`, `eps_hat = x + (1 - sigma) v`.
    """
    dt = sigma_next - sigma
    if kind == "ode":
        return jnp.ones_like(dt), dt, jnp.zeros_like(dt)
    if kind == "sde":
        sigma_safe = jnp.where(sigma >= 1.0, sigma_1, sigma)
        g2 = a**2 * sigma / (1.0 - sigma_safe)
        return 1.0 + g2 * dt / (2 * sigma), (1.0 + g2 * (1.0 - sigma) / (2 * sigma)) * dt, jnp.sqrt(g2 * -dt)
    if kind == "cps":
        std = sigma_next * jnp.sin(a * math.pi / 2)
        rest = jnp.sqrt(jnp.maximum(sigma_next**2 - std**2, 0.0))
        return (1.0 - sigma_next) + rest, -sigma * (1.0 - sigma_next) + (1.0 - sigma) * rest, std
    raise ValueError(f"kernel {kind!r} is not affine; affine kernels: ode, sde, cps")


def lc_step(velocity: Callable, x, v, sigma, sigma_next, a):
    """LC-GRPO (docs/math.md §1): `y = x + v dt`; `score = -(y + (1 - sigma') v(y, sigma')) / sigma'`,
    `delta = 0.5 (a sigma')^2`, `mean = y + delta score`, `std = sqrt(2 delta) = a sigma'`."""
    y = x + column(sigma_next - sigma, x) * v
    active = a * sigma_next > 0
    safe_next = jnp.where(active, sigma_next, 1.0)

    def corrected(y):
        v_y = velocity(y, safe_next)
        score = -(y + column(1.0 - safe_next, y) * v_y) / column(safe_next, y)
        return y + column(0.5 * (a * safe_next) ** 2, y) * score

    if jnp.ndim(active) == 0:  # one step for the whole batch: skip the second call where it is Euler
        mean = jax.lax.cond(active, corrected, lambda y: y, y)
    else:
        mean = jnp.where(column(active, y), corrected(y), y)
    return mean, jnp.where(active, a * sigma_next, 0.0)


def transition(kind: str, velocity: Callable, x, sigma, sigma_next, a, sigma_1):
    """-> (mean [B, H, W, C], std [B], v [B, H, W, C]) of the kernel `kind` from state `x` (module doc)."""
    if kind not in KINDS:
        raise ValueError(f"unknown kernel {kind!r}; choose one of {KINDS}")
    b = x.shape[0]
    dtype = jnp.promote_types(x.dtype, jnp.float32)  # float32 for float32 / bf16 states; float64 ones (x64 tests) keep it
    sigma, sigma_next, a = (jnp.broadcast_to(jnp.asarray(s, dtype), (b,)) for s in (sigma, sigma_next, a))
    v = velocity(x, sigma)
    if kind == "lc":
        mean, std = lc_step(velocity, x, v, sigma, sigma_next, a)
        return mean, std, v
    c_x, c_v, std = affine_coefficients(kind, sigma, sigma_next, a, sigma_1)
    return column(c_x, x) * x + column(c_v, x) * v, std, v


def element_logprob(x_next, mean, std):
    """Per-element Gaussian log-density `-(x' - mu)^2 / (2 std^2) - log std - 0.5 log(2 pi)`; std [B]."""
    s = column(std, x_next)
    return -jnp.square(x_next - mean) / (2 * s**2) - jnp.log(s) - 0.5 * math.log(2 * math.pi)


def token_logprob(x_next, mean, std, patch_size: int, form: str = "gaussian", reduce: str = "mean"):
    """Per-token log-prob `l [B, N]` (docs/math.md §1): the per-element density reduced (`mean`, or `sum`) over
    each DiT token's `p*p*C` elements. Deterministic samples (std = 0) get 0.

    `form="cps_compat"` is Flow-CPS's published log-prob `-(x' - mu)^2` (constants and the `1/(2 std^2)`
    dropped, which rescales log-ratios by `2 std^2`)."""
    if form not in LOGPROB_FORMS:
        raise ValueError(f"unknown log-prob form {form!r}; choose one of {LOGPROB_FORMS}")
    stochastic = std > 0
    if form == "gaussian":
        density = element_logprob(x_next, mean, jnp.where(stochastic, std, 1.0))
    else:
        density = -jnp.square(x_next - mean)
    tokens = patchify(density, patch_size)
    l = tokens.mean(-1) if reduce == "mean" else tokens.sum(-1)
    return jnp.where(stochastic[:, None], l, 0.0)
