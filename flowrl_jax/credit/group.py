"""Group-relative advantages (Flow-GRPO, docs/math.md §2) and the `uniform` credit scheme (docs/math.md §3).

    A = group_advantages(rewards [B], group_ids [B], num_groups, global_std=True, clip=5.0, eps=1e-4, ddof=0)   # [B]
    A_null = permute_within_groups(A, group_ids, key)                                        # the null control

`A[b] = (r[b] - mean_{g[b]} r) / (std + eps)`, the std over the sample's prompt group or, with
`global_std`, over the whole (gathered, global) batch, with `ddof` (0: numpy's population std, flow_grpo's
`stat_tracking.py` with eps 1e-4; 1: torch's default, MixGRPO's per-group `std() + 1e-8`); clipped to `[-clip, clip]`. Rewards are a
global `jax.Array`, so on a pod the statistics cover every process's samples.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def group_advantages(rewards, group_ids, num_groups: int, global_std: bool = True, clip: float = 5.0, eps: float = 1e-4,
                     ddof: int = 0):
    """[B] advantages (module doc); `group_ids [B]` int in `[0, num_groups)`."""
    r = rewards.astype(jnp.float32)
    count = jax.ops.segment_sum(jnp.ones_like(r), group_ids, num_groups)
    mean = jax.ops.segment_sum(r, group_ids, num_groups) / jnp.maximum(count, 1.0)
    centered = r - mean[group_ids]
    if global_std:
        std = jnp.std(r, ddof=ddof)
    else:
        var = jax.ops.segment_sum(jnp.square(centered), group_ids, num_groups) / jnp.maximum(count - ddof, 1.0)
        std = jnp.sqrt(var)[group_ids]
    return jnp.clip(centered / (std + eps), -clip, clip)


def permute_within_groups(x, group_ids, key):
    """`x [B, ...]` with its rows shuffled within each prompt group (the null control, docs/math.md §2: advantages
    that carry no information about their own sample). `group_ids [B]` any integers; a row only ever
    moves to a row of its own group, so each group keeps its multiset of values."""
    u = jax.random.uniform(key, group_ids.shape)
    by_group = jnp.argsort(group_ids, stable=True)   # the rows of each group, in order
    shuffled = jnp.lexsort((u, group_ids))           # the same groups, rows in random order
    return x.at[by_group].set(x[shuffled])


def uniform(inputs: dict, adv, state, cfg):
    """Flow-GRPO's credit: every trained step and token of a sample gets its advantage, `A[b, t, k] = A[b]`."""
    num_steps = inputs["schedule"].levels.shape[0]
    return jnp.broadcast_to(adv, (adv.shape[0], num_steps, adv.shape[2])), state
