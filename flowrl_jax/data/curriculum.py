"""AdaGRPO's online prompt curriculum (docs/math.md §5).

    state = init(num_prompts)                          # {"mean", "std", "count"} [P], in the TrainState
    idx = draw(state, n, rng, options)                 # [n] prompt indices for the next iteration
    state = update(state, idx, rewards [n, G], options)

Per prompt `c`: an EMA (decay `decay`) of its group's mean reward `p_c` and group std `s_c`. The next
batch draws `explore` of its prompts uniformly from all prompts, the rest with probability
proportional to `s_c + floor` among prompts with `p_c` inside the learning band `[lo, hi]` (unseen
prompts count as inside; they weigh as the largest seen `s_c`, so new prompts are tried early; our
choice, docs/math.md leaves it open). If no prompt is in the band, all prompts are candidates. Prompts that
are always solved or never solved leave the band and are then drawn by exploration only.
"""
from __future__ import annotations

import numpy as np

from flowrl_jax.options import resolve

DEFAULTS = {"enabled": False, "lo": 0.1, "hi": 0.9, "floor": 0.05, "explore": 0.1, "decay": 0.7}


def _opt(options, name) -> float:
    return float(resolve(DEFAULTS, options, owner="curriculum")[name])


def init(num_prompts: int) -> dict:
    return {"mean": np.zeros(num_prompts, np.float32), "std": np.zeros(num_prompts, np.float32),
            "count": np.zeros(num_prompts, np.int32)}


def probabilities(state: dict, options=None) -> np.ndarray:
    """[P] the non-exploration draw's distribution over prompts."""
    mean, std, seen = np.asarray(state["mean"]), np.asarray(state["std"]), np.asarray(state["count"]) > 0
    lo, hi, floor = _opt(options, "lo"), _opt(options, "hi"), _opt(options, "floor")
    inside = ~seen | ((mean >= lo) & (mean <= hi))
    if not inside.any():
        inside = np.ones_like(inside)
    spread = np.where(seen, std, std[seen].max() if seen.any() else 1.0)
    weight = np.where(inside, spread + floor, 0.0)
    return weight / weight.sum()


def draw(state: dict, n: int, rng: np.random.Generator, options=None) -> np.ndarray:
    num_prompts = len(state["mean"])
    explore = rng.random(n) < _opt(options, "explore")
    return np.where(explore, rng.integers(num_prompts, size=n), rng.choice(num_prompts, size=n, p=probabilities(state, options)))


def update(state: dict, idx: np.ndarray, rewards: np.ndarray, options=None) -> dict:
    """Fold in the rewards `[n, G]` of the groups of prompts `idx [n]` (a prompt drawn twice: both, in order)."""
    d = _opt(options, "decay")
    mean, std, count = (np.array(state[k]) for k in ("mean", "std", "count"))
    for i, r in zip(np.asarray(idx), np.asarray(rewards, np.float32)):
        first = count[i] == 0
        mean[i] = r.mean() if first else d * mean[i] + (1 - d) * r.mean()
        std[i] = r.std() if first else d * std[i] + (1 - d) * r.std()
        count[i] += 1
    return {"mean": mean.astype(np.float32), "std": std.astype(np.float32), "count": count}
