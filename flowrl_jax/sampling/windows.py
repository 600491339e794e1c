"""Where the SDE window sits at each iteration (docs/math.md §1): fixed, drawn at random (Flow-GRPO-Fast) or sliding (MixGRPO).

    start, size = window_at(config.sampler, it, seed)        # host ints, the same on every process
    levels = levels_at(config.sampler, it, seed)             # [T] the noise level per step of iteration `it`

`sampler.sde_window = (start, size)` is the window (`()` = every step); `sampler.window` (`DEFAULTS`) says how it moves:
- `fixed`: the same window every iteration (Flow-GRPO, DanceGRPO).
- `random` (flow_grpo's `train_sd3_fast.py`): each iteration draws `start` uniformly in `range[0] .. range[1] - size`
  (inclusive; upstream's `random.randint(lo, hi - size)`), from `keys.host(seed, "window", it)`: every process draws the same.
- `sliding` (MixGRPO's `--sample_strategy progressive`, `fastvideo/utils/grpo_states.py`): `start = start_0 +
  (it // shift_every) * stride`. With `end="truncate"` (upstream's): a window holds the steps `start .. min(start + size,
  T - 2) - 1` (upstream's `max_timesteps = sampling_steps - 2`), so it shrinks near the end and is empty at start
  `T - 2`; past that start it rolls back to `start_0` (`wrap`, `--roll_back`) or stays there (clip, empty). With
  `end="whole"`: windows keep their size and wrap back to 0 past the last start that fits (this project's earlier rule).
Only the window's steps are trained (`objectives.grpo.slots`); the rollout's levels are [T] whatever the window, so one
compile serves every window (a shorter one gives fewer training pairs: fewer optimizer steps, none when empty).
After the window, `tail_solver` ("euler", or "dpm2m": DPM-Solver++(2M), MixGRPO's ODE sampler) runs on `tail_ratio` of
the remaining steps (MixGRPO-Flash: 0.4; `rollout.tail_schedule`); 1.0 keeps every step.
"""
from __future__ import annotations

import numpy as np

from flowrl_jax import keys
from flowrl_jax.options import resolve
from flowrl_jax.sampling.rollout import check_tail, noise_levels

SCHEDULES = ("fixed", "random", "sliding")
DEFAULTS = {"schedule": "fixed", "range": (), "shift_every": 25, "stride": 1, "wrap": True, "end": "truncate",
            "tail_solver": "euler", "tail_ratio": 1.0}
ENDS = ("truncate", "whole")


def base_window(sampler) -> tuple[int, int]:
    """`sampler.sde_window` as (start, size); `()` = every step."""
    return tuple(sampler.sde_window) if sampler.sde_window else (0, sampler.num_steps)


def tail(sampler) -> dict:
    """The rollout's keyword arguments for the steps after the window: `tail_solver`, `tail_ratio`, and the sampler's
    `shift` the coarser grid is spaced under (`rollout.tail_schedule`; module doc)."""
    o = resolve(DEFAULTS, sampler.get("window"), owner="sampler.window")
    check_tail(o.tail_solver, o.tail_ratio, "sampler.window.")
    return {"tail_solver": o.tail_solver, "tail_ratio": float(o.tail_ratio), "tail_shift": float(sampler.get("shift", 1.0))}


def window_at(sampler, it: int, seed: int) -> tuple[int, int]:
    """(start, size) of the SDE window at iteration `it` (module doc); ValueError naming the option when it cannot fit."""
    o = resolve(DEFAULTS, sampler.get("window"), owner="sampler.window")
    start, size = base_window(sampler)
    steps = sampler.num_steps
    if o.schedule not in SCHEDULES:
        raise ValueError(f"sampler.window.schedule={o.schedule!r}: choose one of {', '.join(SCHEDULES)}")
    if o.schedule == "random":
        lo, hi = tuple(o.range) if o.range else (0, steps)
        if not 0 <= lo <= hi - size or hi > steps:
            raise ValueError(f"sampler.window.range=({lo}, {hi}) cannot hold a window of {size} steps in {steps}: "
                             f"need 0 <= lo <= hi - {size} and hi <= {steps}")
        return int(keys.host(seed, "window", it).integers(lo, hi - size + 1)), size
    if o.schedule == "sliding":
        if o.shift_every < 1 or o.stride < 0:
            raise ValueError(f"sampler.window.shift_every={o.shift_every} must be >= 1 and stride={o.stride} >= 0")
        if o.end not in ENDS:
            raise ValueError(f"sampler.window.end={o.end!r}: choose one of {', '.join(ENDS)}")
        moves = it // o.shift_every
        if o.end == "whole":
            start, last = start + moves * o.stride, steps - size
            return (start % (last + 1) if o.wrap else min(start, last)), size
        limit = steps - 2  # MixGRPO's max_timesteps: a window's steps end before it
        if start > limit:
            raise ValueError(f"sampler.sde_window starts at {start}, past the last sliding start {limit} of {steps} steps "
                             "(MixGRPO's sampling_steps - 2)")
        if o.wrap and o.stride:  # roll back to start_0 once the start passes the limit
            start += (moves % ((limit - start) // o.stride + 1)) * o.stride
        else:
            start = min(start + moves * o.stride, limit)
        return start, max(0, min(start + size, limit) - start)
    return start, size


def sampler_levels(sampler, window: tuple[int, int] | None = None) -> np.ndarray:
    """[T] noise level per step: `sampler.noise_level` on the SDE window's steps (`window` (start, size), or the config's
    own), 0 elsewhere, and 0 everywhere for the `ode` sampler."""
    window = window or base_window(sampler)
    if window[1] == 0:  # a sliding window past its end (`window_at`): every step ODE
        return np.zeros(sampler.num_steps, np.float32)
    levels = np.asarray(noise_levels(sampler.num_steps, sampler.noise_level, window))
    return levels * 0.0 if sampler.kind == "ode" else levels


def levels_at(sampler, it: int, seed: int) -> np.ndarray:
    """[T] the noise level per step at iteration `it`: the SDE window of `sampler.window`'s schedule (module doc)."""
    return sampler_levels(sampler, window_at(sampler, it, seed))
