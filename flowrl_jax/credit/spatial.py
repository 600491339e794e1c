"""Gradient-guided spatial credit for DiTs (docs/math.md §3 `spatial`).

    c[b, t, k] = || dR/dx0_hat_t [b, token k] ||_2   gradient of the differentiable reward model at step t's
                                                    Tweedie estimate, over each DiT token's p*p*C elements
    z = (c - median_k c) / (1.4826 MAD_k(c) + 1e-6),  clipped to [-z_clip, z_clip]
    w = N softmax(z / tau)                    mean 1 over the N tokens
    A[b, t, k] = A[b, t] w[b, t, k]           run it with per-token ratios (objective.grpo.ratio = "token")

Options (`DEFAULTS`, `config.credit.spatial`): `tau`, `z_clip`, and `map_at`: "tweedie" (docs/math.md: one map per
trained step, from the gradient at that step's `x0_hat`; untrained steps get uniform weights) or "final"
(one map from the gradient at the final sample, reused at every step: cheaper, one gradient per sample).
Median/MAD (not mean/std) keep one outlier token from rescaling every other token's z. The clip at
`z_clip` is ours (docs/math.md gives none): without it a single extreme token takes nearly all the softmax mass
(its z is huge under MAD as under z-score) and so still moves the others' weights; with it the outlier's
weight is at most `e^(z_clip / tau)` times a median token's (tests/test_credit.py measures both).
`tau -> inf` recovers uniform credit. The reward that trains the policy need not be the differentiable one
(the exact evaluator has no gradient): the reward model only draws the map.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from flowrl_jax.models.mmdit import patchify

DEFAULTS = {"tau": 2.0, "z_clip": 3.0, "map_at": "tweedie"}
MAP_AT = ("tweedie", "final")


def check(options) -> None:
    if options.map_at not in MAP_AT:
        raise ValueError(f"credit.spatial.map_at={options.map_at!r}: choose one of {', '.join(MAP_AT)}")


def prepare(ctx, options) -> dict:
    """{"gradient": [B, T, H, W, C]} at each trained step's Tweedie estimate (zeros elsewhere), or [B, H, W, C] at
    the final sample (`map_at="final"`)."""
    ro = ctx.rollout
    if options.map_at == "final":
        return {"gradient": ctx.reward_gradient(ro.final)}
    trained = np.asarray(ctx.schedule.trained)
    grads = [ctx.reward_gradient(ro.x0_hat[:, t]) if trained[t] else jnp.zeros_like(ro.final) for t in range(trained.size)]
    return {"gradient": jnp.stack(grads, axis=1)}


def token_norms(gradient, patch_size: int):
    """[B, (T,) H, W, C] -> c [B, (T,) N]: the L2 norm of the gradient over each token's elements."""
    if gradient.ndim == 5:
        return jax.vmap(lambda g: token_norms(g, patch_size), in_axes=1, out_axes=1)(gradient)
    return jnp.sqrt(jnp.sum(jnp.square(patchify(gradient, patch_size)), axis=-1))


def mad_weights(c, tau: float = DEFAULTS["tau"], z_clip: float = DEFAULTS["z_clip"]):
    """c [..., N] -> w [..., N], `N softmax(clip(z) / tau)` with MAD-normalized z over the tokens (module doc)."""
    med = jnp.median(c, axis=-1, keepdims=True)
    mad = jnp.median(jnp.abs(c - med), axis=-1, keepdims=True)
    z = jnp.clip((c - med) / (1.4826 * mad + 1e-6), -z_clip, z_clip)
    return c.shape[-1] * jax.nn.softmax(z / tau, axis=-1)


def patch_size_of(ro) -> int:
    h, w = ro.states.shape[2:4]
    return int(round((h * w / ro.logp.shape[-1]) ** 0.5))


def weights(inputs: dict, options):
    """[B, T, N] token weights per step (the final-image map broadcast over the steps)."""
    ro = inputs["rollout"]
    c = token_norms(inputs["spatial"]["gradient"], patch_size_of(ro))
    w = mad_weights(c, float(options.tau), float(options.z_clip))
    return jnp.broadcast_to(w[:, None, :], (w.shape[0], inputs["schedule"].levels.shape[0], w.shape[-1])) if w.ndim == 2 else w


def apply(inputs: dict, adv, state, options):
    return adv * weights(inputs, options), state


def debug_images(ctx, extras: dict, options) -> dict:
    """{"credit_maps": save_grid kwargs}: the first `n` samples of this process (top row) and the credit
    maps of the first trained step over them (bottom row, brighter = more credit; each map scaled to its own max)."""
    first = int(np.flatnonzero(np.asarray(ctx.schedule.trained))[0])  # the map of the first trained step
    w = weights({"rollout": ctx.rollout, "schedule": ctx.schedule, **extras}, options)[:, first]
    images, labels = ctx.local(ctx.decode(ctx.rollout.final)), [p["prompt"] for p in ctx.prompts_local]
    p, (h, wd) = patch_size_of(ctx.rollout), ctx.rollout.states.shape[2:4]
    return {"credit_maps": overlay_grid(images, ctx.local(w), (h // p, wd // p), labels)}


def overlay_grid(images, w, grid: tuple[int, int], labels=None, n: int = 12) -> dict:
    """`metrics.save_grid` kwargs: images [B, H, W, 3] in [-1, 1] over their token weights w [B, N] (N = gh x gw tokens of
    the DiT's `grid`, pixels or latents) as a heat map, each token's cell blown up to the image's size."""
    images, w = np.asarray(images[:n], np.float32), np.asarray(w[:n], np.float32)
    b, h, wd, _ = images.shape
    maps = w.reshape(b, *grid) / np.maximum(w.reshape(b, -1).max(1), 1e-8)[:, None, None]
    maps = np.kron(maps, np.ones((h // grid[0], wd // grid[1])))[..., None]
    heat = np.concatenate([maps, maps * 0.6, 1 - maps], axis=-1) * 2 - 1  # blue (little) -> orange (much)
    overlay = 0.45 * images + 0.55 * heat
    return {"images": np.concatenate([images, overlay]), "rows": 2, "labels": list(labels[:n]) * 2 if labels else None,
            "row_titles": ["sample", "credit w"]}
