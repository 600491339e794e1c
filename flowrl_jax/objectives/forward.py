"""Forward-process minibatches (docs/math.md §0, §6): the rollout's final samples `x0`, noised afresh.

    mb = forward_pairs(ro, adv, cond, null, rows, slots, weight, key, t)    # t [M]: each pair's time -> batch.Minibatch
    mb = pairs(data, rows, slots, weight, key, options)    # the objectives' shared signature

A pair is (sample `rows[m]`, time slot `slots[m]`) at time `t[m]`, `eps ~ N(0, I)` drawn from `key` (fresh
for every update), `x_t = (1 - t) x0 + t eps`, flow-matching target `eps - x0`. The option `times` picks
the slot's time:
- "midpoints": `timesteps` fixed times spread over (0, 1) (`training_times`), the same for every sample;
- "sampler": the sampler's own times `sigma_0 .. sigma_{T-1}` in a random order per sample (drawn once per
  iteration from `data.key`), its first `timesteps` used: DiffusionNFT's public code, which trains each
  sample at 9 of its 10 sampler timesteps (`timestep_fraction = 0.99`).
The per-sample advantage is the mean of the credit chain's `A[b, t, k]` over steps and tokens
(forward-process objectives have no per-step ratio).
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np

from flowrl_jax.objectives.batch import IterationData, Minibatch
from flowrl_jax.sampling import kernels, schedule


def slots(options, levels) -> np.ndarray:
    """The time slots every sample is trained at: `0 .. options.timesteps - 1`."""
    return np.arange(options.timesteps)


TIMES = ("midpoints", "sampler")


def check_times(options, sampler, owner: str) -> None:
    if options["times"] not in TIMES:
        raise ValueError(f"objective.{owner}.times={options['times']!r}: choose one of {', '.join(TIMES)}")
    if options["times"] == "sampler" and not 1 <= options["timesteps"] <= sampler.num_steps:
        raise ValueError(f"objective.{owner}.timesteps={options['timesteps']} of the sampler's {sampler.num_steps} times: "
                         f"choose 1 .. {sampler.num_steps} (sampler.num_steps)")


def pair_times(iteration_key, rows, slots, options) -> jax.Array:
    """[M] the time of each pair under `options.times` (module doc); `iteration_key`: the iteration's (`IterationData.key`)."""
    if options["times"] == "midpoints":
        return training_times(options["timesteps"], options["shift"])[slots]
    sigmas = schedule.sigmas(options["num_steps"], options["shift"], options.get("grid", "sd3"))[:-1]
    order = jax.vmap(lambda r: jax.random.permutation(jax.random.fold_in(iteration_key, r), sigmas.shape[0]))(rows)
    return sigmas[jnp.take_along_axis(order, slots[:, None], axis=1)[:, 0]]


def pairs(data: IterationData, rows, slots, weight, key, options) -> Minibatch:
    """`forward_pairs` on the iteration's data at the times of `options.times`."""
    t = pair_times(data.key, rows, slots, options)
    return forward_pairs(data.rollout, data.adv, data.cond, data.null, rows, slots, weight, key, t)


def offers(options) -> frozenset:
    """No per-step or per-token ratio: only credit that yields one advantage per sample applies."""
    return frozenset()


def training_times(num_slots: int, shift: float) -> jnp.ndarray:
    """[num_slots] times in (0, 1): the midpoints of `num_slots` equal bins, shifted like the sampler's
    schedule (docs/math.md §0 `sh`), e.g. 4 slots at shift 1: .125, .375, .625, .875."""
    return schedule.shift_sigma((jnp.arange(num_slots, dtype=jnp.float32) + 0.5) / num_slots, shift)


def forward_pairs(ro, adv, cond, null_cond, rows, slots, weight, key, t) -> Minibatch:
    """The minibatch of M forward-process pairs (module doc): x0, eps, x_t [M, H, W, C], t [M], adv [M],
    `adv_floor` = max(-A) over the whole batch, the condition, weight [M] (0 on padding), slot [M]."""
    chex.assert_rank([rows, slots, weight, t], 1)
    x0 = ro.final[rows]
    eps = jax.random.normal(key, x0.shape, x0.dtype)
    x_t = kernels.column(1.0 - t, x0) * x0 + kernels.column(t, x0) * eps
    per_sample = adv.mean(axis=(1, 2))
    pick = lambda tree: jax.tree_util.tree_map(lambda a: a[rows], tree)  # noqa: E731
    return Minibatch(pairs={"x0": x0, "eps": eps, "x_t": x_t, "t": t, "adv": per_sample[rows], "cond": pick(cond),
                            "null": pick(null_cond), "weight": weight, "step": slots},
                     shared={"adv_floor": jnp.max(-per_sample)})


def weighted_mean(values, weight):
    """sum_m w_m values_m / max(sum w, 1): the mean over the real (non-padding) pairs."""
    return jnp.sum(weight * values) / jnp.maximum(weight.sum(), 1.0)
