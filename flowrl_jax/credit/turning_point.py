"""TurningPoint-GRPO credit, as published (docs/math.md §3 `turning_point`).

For each sample, with the trajectory's `m` SDE (trained) steps:
    R_k  (k < m)  reward of the ODE completion from the state before the k-th SDE step     # prepare
    R_m = R_n     reward of the sample itself (the rollout finishes the window's last state by ODE)
    d_k = R_{k+1} - R_k,   D_g = R_n - R_0,   s_k = sign(d_k) sign(D_g)
    turning point: k = 0: sign(d_0) sign(R_n - R_1) > 0;
                   k >= 1: s_{k-1} < 0, s_k > 0 and sign(d_k) sign(R_n - R_{k+1}) > 0
The `sign(d_k) sign(R_n - R_{k+1}) > 0` terms are TP-GRPO's consistent-trajectory selection (the step moves toward
R_n and R_n is still ahead). Options (`DEFAULTS`, `config.credit.turning_point`), as its launch scripts
(`scripts/single_node/common_op3.sh`) set them, where its `config/my_grpo.py` defaults have them off:
`consistent_first_step` (False: k = 0 is a turning point when s_0 > 0) and `consistent_inter_step` (False: k >= 1
needs only s_{k-1} < 0 < s_k).
    R~_k = R_n - R_k at a turning point, else d_k
Balanced bonus, as TP-GRPO's public code (`use_balanced_bonus`): when turning points of both signs of
`D_g` are present in the batch, keep `min(#pos, #neg)` of each sign, those with the largest `|D_g|` (ties:
lower index first), and the rest fall back to `d_k`; when only one sign is present, all are kept. The
public code balances within each GPU's sampling batch; here the batch is the iteration's whole (global)
batch, all processes' samples. Turning points with `D_g = 0` have no sign and fall back to `d_k` (in the
public code they are dropped by balancing or get a bonus `R_n - R_0 = 0`, which falls back to `d_0`).
Advantage: `R~_k` normalized per step within each prompt group (group std), clipped -> `A [B, T, 1]`,
0 on untrained steps. The completions are one batched ODE scan (`sampling.rollout.complete`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

DEFAULTS = {"consistent_first_step": True, "consistent_inter_step": True}


def prepare(ctx, options) -> dict:
    """-> {"completion_rewards": [B, m]}: rewards of the ODE completions from each trained step's state."""
    steps = np.flatnonzero(np.asarray(ctx.schedule.trained))
    completions = ctx.ode_completions(steps)
    return {"completion_rewards": ctx.rewards_of(completions)}


def turning_points(completion_rewards, final_rewards, consistent_first_step: bool = True, consistent_inter_step: bool = True):
    """`R_0..R_{m-1}` [B, m] and `R_n` [B] -> [B, m] bool: the turning points before balancing (module doc)."""
    r_n = final_rewards[:, None]
    r = jnp.concatenate([completion_rewards, r_n], axis=1)  # [B, m + 1]
    d = r[:, 1:] - r[:, :-1]
    s = jnp.sign(d) * jnp.sign(r[:, -1] - r[:, 0])[:, None]
    toward_end = jnp.sign(d) * jnp.sign(r_n - r[:, 1:]) > 0  # [B, m]: the step moves toward R_n and R_n is still ahead
    later = (s[:, :-1] < 0) & (s[:, 1:] > 0) & (toward_end[:, 1:] if consistent_inter_step else True)
    first = toward_end[:, :1] if consistent_first_step else s[:, :1] > 0
    return jnp.concatenate([first, later], axis=1)


def step_rewards(completion_rewards, final_rewards, **selection):
    """-> (R~ [B, m], the turning points kept by the balanced bonus [B, m]) (module doc); `selection`: DEFAULTS' flags."""
    r = jnp.concatenate([completion_rewards, final_rewards[:, None]], axis=1)
    d = r[:, 1:] - r[:, :-1]
    keep = balanced(turning_points(completion_rewards, final_rewards, **selection), r[:, -1] - r[:, 0])
    return jnp.where(keep, r[:, -1:] - r[:, :-1], d), keep


def balanced(turning, d_g):
    """[B, m] turning points kept by the balanced bonus (module doc)."""
    mag = jnp.broadcast_to(jnp.abs(d_g)[:, None], turning.shape).ravel()
    kept = jnp.zeros(mag.shape, bool)
    pos = (turning & (d_g > 0)[:, None]).ravel()
    neg = (turning & (d_g < 0)[:, None]).ravel()
    n_pos, n_neg = pos.sum(), neg.sum()
    n_keep = jnp.where((n_pos > 0) & (n_neg > 0), jnp.minimum(n_pos, n_neg), mag.size)  # one sign only: keep all
    for cls in (pos, neg):
        order = jnp.argsort(jnp.where(cls, -mag, jnp.inf), stable=True)  # largest |D_g| first
        rank = jnp.zeros(mag.shape, jnp.int32).at[order].set(jnp.arange(mag.size, dtype=jnp.int32))
        kept = kept | (cls & (rank < n_keep))
    return kept.reshape(turning.shape)


def apply(inputs: dict, adv, state, options):
    levels = inputs["schedule"].levels
    rc = inputs["turning_point"]["completion_rewards"]
    r_tilde, _ = step_rewards(rc, inputs["rewards"].astype(jnp.float32), **{k: bool(options[k]) for k in DEFAULTS})
    a = jax.vmap(lambda r: inputs["normalize"](r, group_std=True), in_axes=1, out_axes=1)(r_tilde)  # [B, m]
    steps = jnp.flatnonzero(levels > 0, size=rc.shape[1])
    full = jnp.zeros((a.shape[0], levels.shape[0]), jnp.float32).at[:, steps].set(a)
    return full[:, :, None], state
