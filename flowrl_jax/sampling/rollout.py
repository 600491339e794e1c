"""Trajectories of the reverse process under one transition kernel, as a `lax.scan` (docs/math.md §1, §6).

    velocity = guided(velocity_fn, cond, null_cond, cfg)         # CFG velocity, (x, sigma) -> v
    schedule = Schedule(sigmas, noise_levels(T, a, window))      # the steps, shared by every row
    ro = rollout(velocity, x_T, schedule.sigmas, schedule.levels, rng, kind="sde", patch_size=p)
    images = ro.final                                            # [B, H, W, C]
    x0 = sample(velocity, x_T, sigmas)                           # ODE, final sample only
    x0s = complete(velocity_of, states [B, m, ...], steps, sigmas)  # ODE from states mid-trajectory

A `Rollout` holds, per sample and step (`[B, T, ...]`, batch first so that it shards on the mesh's
data axes): the state `x_t`, the next state, the kernel's mean and std, the per-token log-prob `l[b, t, k]`
of the next state, and the Tweedie estimate `x0_hat = x_t - sigma_t v`: every field has the row axis, so a
rollout sampled in chunks of rows is the chunks side by side. The `Schedule` it was drawn on (sigmas, noise
level per step) is shared by every row and kept apart. Steps outside the SDE window run the ODE (noise level
0, std 0, log-prob 0) and are never trained (`Schedule.trained`).

Everything is a global `jax.Array`: jit it with the batch sharded on the mesh (`parallel.batch_sharding`)
and it runs unchanged on one device, eight, or a multi-host pod; the noise is drawn inside for the global
batch, so the result does not depend on the sharding.
"""
from __future__ import annotations

from typing import Any, Callable

import chex
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from flowrl_jax.sampling import kernels, schedule


@flax.struct.dataclass
class Rollout:
    """Per row (the batch axis first in every field)."""
    states: jax.Array        # [B, T, H, W, C] x_t before step t
    next_states: jax.Array   # [B, T, H, W, C]
    means: jax.Array         # [B, T, H, W, C] kernel mean under the rollout policy
    stds: jax.Array          # [B, T]
    logp: jax.Array          # [B, T, N] per-token log-prob of next_states (0 on ODE steps)
    x0_hat: jax.Array        # [B, T, H, W, C] Tweedie estimate at x_t

    @property
    def final(self) -> jax.Array:
        return self.next_states[:, -1]


@flax.struct.dataclass
class Schedule:
    """The steps a rollout was drawn on, shared by every row."""
    sigmas: jax.Array        # [T + 1] step t goes sigmas[t] -> sigmas[t + 1]
    levels: jax.Array        # [T] the kernel's noise level `a` per step, 0 outside the SDE window

    @property
    def trained(self) -> jax.Array:
        """[T] bool: the steps an objective trains on (inside the SDE window)."""
        return self.levels > 0


def guided(velocity_fn: Callable, cond: Any, null_cond: Any, cfg: float, detach_uncond: bool = False) -> Callable:
    """`(x, sigma [B]) -> v_u + cfg (v_c - v_u)` (docs/math.md §0), both branches in one doubled batch;
    `velocity_fn(x, sigma, cond) -> v`. cfg == 1 skips the unconditional branch. `detach_uncond`
    (Flow-GRPO's training forward): no gradient through `v_u`, and the two branches run as two
    batches so that the backward pass covers the conditional one only."""

    def velocity(x, sigma):
        if cfg == 1.0:
            return velocity_fn(x, sigma, cond)
        if detach_uncond:
            v_c, v_u = velocity_fn(x, sigma, cond), jax.lax.stop_gradient(velocity_fn(x, sigma, null_cond))
            return v_u + cfg * (v_c - v_u)
        b = x.shape[0]
        both = jax.tree_util.tree_map(lambda c, u: jnp.concatenate([c, u]), cond, null_cond)
        v = velocity_fn(jnp.concatenate([x, x]), jnp.concatenate([sigma, sigma]), both)
        return v[b:] + cfg * (v[:b] - v[b:])

    return velocity


def noise_levels(num_steps: int, a: float, window: tuple[int, int] | None = None) -> jnp.ndarray:
    """[T]: `a` on the SDE window's steps `start .. start + size - 1`, 0 (ODE) elsewhere; None = all steps."""
    start, size = window if window is not None else (0, num_steps)
    if not (0 <= start and size >= 1 and start + size <= num_steps):
        raise ValueError(f"sde_window=({start}, {size}) does not fit in {num_steps} steps: need 0 <= start, size >= 1, "
                         f"start + size <= {num_steps}")
    steps = jnp.arange(num_steps)
    return jnp.where((steps >= start) & (steps < start + size), a, 0.0).astype(jnp.float32)


def initial_noise(rng, shape, group_size: int = 1, same_per_group: bool = False) -> jax.Array:
    """x_T [B, H, W, C]; with `same_per_group` every run of `group_size` rows (one prompt's group) shares it."""
    if not same_per_group:
        return jax.random.normal(rng, shape)
    groups = jax.random.normal(rng, (shape[0] // group_size,) + tuple(shape[1:]))
    return jnp.repeat(groups, group_size, axis=0)


TAIL_SOLVERS = ("euler", "dpm2m")


def check_tail(solver: str, ratio: float, prefix: str = "") -> None:
    """ValueError naming `{prefix}tail_solver` / `tail_ratio` unless the solver is known and 0 < ratio <= 1."""
    if solver not in TAIL_SOLVERS or not 0 < ratio <= 1:
        raise ValueError(f"{prefix}tail_solver={solver!r}, tail_ratio={ratio}: choose a solver in {', '.join(TAIL_SOLVERS)} "
                         "and a ratio in (0, 1]")


def tail_schedule(sigmas, levels, ratio: float = 1.0, shift: float = 1.0):
    """The steps after the SDE window on a coarser grid (MixGRPO-Flash's `dpm_apply_strategy="post"`,
    `fastvideo/utils/sampling_utils.py`): with `e` one past the last SDE step (0 when there is none), upstream's
    `int((T - e + 1) ratio)` grid points spaced evenly in unshifted time from `t_e` (sigma_e unshifted by `shift`) to 0,
    each shifted back; so `n = max(1, points - 1)` steps (upstream keeps 1 point, never reaching 0, where the product
    is below 2: ours takes one step to 0 there). Tail step `e + j` (j < n) goes `sh(t_e (1 - j/n)) -> sh(t_e (1 - (j+1)/n))`;
    steps past `e + n` are skipped. `ratio = 1` keeps every step of the base grid. -> (sigma_from [T], sigma_to [T],
    active [T] bool, tail [T] bool); traced, so a window that moves per iteration needs no new compile."""
    num_steps = levels.shape[0]
    idx = jnp.arange(num_steps)
    e = jnp.max(jnp.where(levels > 0, idx + 1, 0))
    tail_len = (num_steps - e).astype(jnp.float32)
    points = jnp.floor((tail_len + 1.0) * ratio + 1e-5)  # upstream's int(...); 1e-5 absorbs float32 products like 5 x 0.4
    n = jnp.maximum(1.0, points - 1.0)
    j = (idx - e).astype(jnp.float32)
    sigma_e = sigmas[e]
    t_e = schedule.unshift_sigma(sigma_e, shift)
    at = lambda k: schedule.shift_sigma(t_e * jnp.clip(1.0 - k / n, 0.0, 1.0), shift)  # noqa: E731
    tail = idx >= e
    regrid = tail & (ratio < 1)
    return (jnp.where(regrid, at(j), sigmas[:-1]), jnp.where(regrid, at(j + 1), sigmas[1:]), ~regrid | (j < n), tail)


def dpm_solver_2m(x, x0, x0_prev, sigma, sigma_next, h_prev):
    """DPM-Solver++(2M) (Lu et al. 2022, data prediction) for `x_sigma = (1 - sigma) x0 + sigma eps`: alpha = 1 - sigma,
    lambda = log(alpha / sigma), h = lambda_next - lambda. First order `x' = (sigma'/sigma) x + alpha' (1 - e^-h) x0`
    (= Euler for this path); second order replaces x0 by `(1 + 1/2r) x0 - (1/2r) x0_prev`, r = h_prev / h, where both
    h are finite (a step from sigma = 1 or to sigma = 0 has h = inf and stays first order). -> (x', h)."""
    alpha, alpha_next = 1.0 - sigma, 1.0 - sigma_next
    inner = (sigma < 1) & (sigma_next > 0)
    h = jnp.where(inner, jnp.log(jnp.where(inner, alpha_next / sigma_next * sigma / alpha, 1.0)), jnp.inf)
    second = inner & jnp.isfinite(h_prev)
    half_inv_r = jnp.where(second, h / (2.0 * jnp.where(second, h_prev, 1.0)), 0.0)
    d = (1.0 + half_inv_r) * x0 - half_inv_r * x0_prev
    return (sigma_next / sigma) * x + (alpha_next - alpha * sigma_next / sigma) * d, h


def rollout(velocity: Callable, x_T, sigmas, levels, rng, kind: str = "sde", patch_size: int = 1,
            logprob_form: str = "gaussian", tail_solver: str = "euler", tail_ratio: float = 1.0, tail_shift: float = 1.0) -> Rollout:
    """Run `T = len(levels)` steps from x_T [B, H, W, C] at `sigmas[0]`; step t uses `kind` with noise
    level `levels[t]` (0 = ODE). The steps after the SDE window use `tail_solver` ("euler", or "dpm2m":
    DPM-Solver++(2M) fed by the previous step's x0, MixGRPO's ODE sampler) on `tail_ratio` of their grid
    (`tail_schedule`; a skipped step leaves the state as it is and calls no velocity). Returns the `Rollout` (module doc)."""
    check_tail(tail_solver, tail_ratio)
    num_steps = levels.shape[0]
    sigma_1 = sigmas[1]
    keys = jax.random.split(rng, num_steps)
    plain = tail_solver == "euler" and tail_ratio == 1.0
    sigma_from, sigma_to, active, tail = ((sigmas[:-1], sigmas[1:], jnp.ones(num_steps, bool), jnp.zeros(num_steps, bool))
                                          if plain else tail_schedule(sigmas, levels, tail_ratio, tail_shift))

    def move(x, x0_prev, h_prev, sigma, sigma_next, a, key, on_tail):
        mean, std, v = kernels.transition(kind, velocity, x, sigma, sigma_next, a, sigma_1)
        x0_hat = x - kernels.column(jnp.broadcast_to(sigma, std.shape), x) * v
        h = h_prev
        if tail_solver == "dpm2m":
            dpm, h = dpm_solver_2m(x, x0_hat, x0_prev, sigma, sigma_next, h_prev)
            mean = jnp.where(on_tail, dpm, mean)  # the tail is ODE: std 0 there
        x_next = mean + kernels.column(std, x) * jax.random.normal(key, x.shape, x.dtype)
        logp = kernels.token_logprob(x_next, mean, std, patch_size, logprob_form)
        return x_next, x0_hat, h, (x, x_next, mean, std.astype(x.dtype), logp.astype(x.dtype), x0_hat)

    def skip(x, x0_prev, h_prev, *_):  # past the tail's coarser grid: the state stays, nothing is sampled
        b = x.shape[0]
        return x, x0_prev, h_prev, (x, x, x, jnp.zeros((b,), x.dtype), jnp.zeros((b, (x.shape[1] // patch_size) * (x.shape[2] // patch_size)), x.dtype), x0_prev)

    def step(carry, inputs):
        x, x0_prev, h_prev = carry
        if plain:
            x_next, x0, h, out = move(x, x0_prev, h_prev, *inputs[:4], False)
        else:
            x_next, x0, h, out = jax.lax.cond(inputs[-1], move, skip, x, x0_prev, h_prev, *inputs[:-1])
        return (x_next, x0, h), out

    carry = (x_T, jnp.zeros_like(x_T), jnp.asarray(jnp.inf, sigmas.dtype))
    _, outs = jax.lax.scan(step, carry, (sigma_from, sigma_to, levels, keys, tail, active))
    states, next_states, means, stds, logp, x0_hat = (jnp.swapaxes(o, 0, 1) for o in outs)
    b = x_T.shape[0]
    chex.assert_shape([states, next_states, means, x0_hat], (b, num_steps) + tuple(x_T.shape[1:]))
    chex.assert_shape(stds, (b, num_steps))
    chex.assert_shape(logp, (b, num_steps, None))
    return Rollout(states, next_states, means, stds, logp, x0_hat)


def sample(velocity: Callable, x_T, sigmas) -> jax.Array:
    """Deterministic Euler (the `ode` kernel) from x_T to sigmas[-1]; the final sample only."""

    def step(x, pair):
        mean, _, _ = kernels.transition("ode", velocity, x, pair[0], pair[1], 0.0, sigmas[1])
        return mean, None

    x, _ = jax.lax.scan(step, x_T, (sigmas[:-1], sigmas[1:]))
    return x


def complete(velocity_of: Callable, states, steps, sigmas) -> jax.Array:
    """`[B, m, H, W, C]`: the ODE sampler from each state `states[:, j]`, the state before step `steps[j]`
    (static ints), to sigmas[-1]. `velocity_of(repeat)` gives the velocity for the `B m` rows, with its
    condition repeated by `repeat(tree)` (each sample's row `m` times). All completions run in one scan
    over the steps; a row waits, unchanged, until its own step."""
    b, m = states.shape[:2]
    x = states.reshape((b * m,) + states.shape[2:])
    start = jnp.tile(jnp.asarray(steps, jnp.int32), b)
    velocity = velocity_of(lambda tree: jax.tree_util.tree_map(lambda a: jnp.repeat(a, m, axis=0), tree))

    def step(x, i):
        mean, _, _ = kernels.transition("ode", velocity, x, sigmas[i], sigmas[i + 1], 0.0, sigmas[1])
        return jnp.where(kernels.column(i >= start, x), mean, x), None

    x, _ = jax.lax.scan(step, x, jnp.arange(int(np.min(steps)), sigmas.shape[0] - 1))
    return x.reshape(states.shape)
