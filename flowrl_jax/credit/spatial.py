"""Gradient-guided spatial credit for DiTs (SPEC.md §3 `spatial`).

    c[b, k] = || dR/dx [b, token k] ||_2      gradient of the learned differentiable reward w.r.t. the
                                              final image, reduced over each DiT token's p*p*C pixels
    z = (c - median_k c) / (1.4826 MAD_k(c) + 1e-6),  clipped to [-z_clip, z_clip]
    w = N softmax(z / tau)                    mean 1 over the N tokens
    A[b, t, k] = A[b, t] w[b, k]              run it with per-token ratios (objective.grpo.ratio = "token")

Median/MAD (not mean/std) keep one outlier token from rescaling every other token's z. The clip at
`z_clip` is ours (SPEC gives none): without it a single extreme token takes all the softmax mass and
so still moves the others' weights; with it the outlier's weight is at most `e^(z_clip / tau)` times
a median token's. `tau -> inf` recovers uniform credit. The reward that trains the policy need not be
the learned one (the exact evaluator has no gradient): the learned one only draws the map.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from flowrl_jax.models.mmdit import patchify

DEFAULTS = {"tau": 2.0, "z_clip": 3.0}


def prepare(ctx, options) -> dict:
    return {"gradient": ctx.reward_gradient(ctx.rollout.final)}


def token_norms(gradient, patch_size: int):
    """[B, H, W, C] -> c [B, N]: the L2 norm of the gradient over each token's pixels."""
    return jnp.sqrt(jnp.sum(jnp.square(patchify(gradient, patch_size)), axis=-1))


def mad_weights(c, tau: float = DEFAULTS["tau"], z_clip: float = DEFAULTS["z_clip"]):
    """c [B, N] -> w [B, N], `N softmax(clip(z) / tau)` with MAD-normalized z (module doc)."""
    med = jnp.median(c, axis=-1, keepdims=True)
    mad = jnp.median(jnp.abs(c - med), axis=-1, keepdims=True)
    z = jnp.clip((c - med) / (1.4826 * mad + 1e-6), -z_clip, z_clip)
    return c.shape[-1] * jax.nn.softmax(z / tau, axis=-1)


def patch_size_of(ro) -> int:
    h, w = ro.states.shape[2:4]
    return int(round((h * w / ro.logp.shape[-1]) ** 0.5))


def weights(inputs: dict, options):
    ro = inputs["rollout"]
    c = token_norms(inputs["spatial"]["gradient"], patch_size_of(ro))
    return mad_weights(c, float(options.tau), float(options.z_clip))


def apply(inputs: dict, adv, state, options):
    w = weights(inputs, options)
    return adv * w[:, None, :], state


def debug_images(ctx, extras: dict, options) -> dict:
    """{"credit_maps": save_grid kwargs}: the first `n` samples of this process (top row) and their credit
    maps over them (bottom row, brighter = more credit; each map scaled to its own max)."""
    w = weights({"rollout": ctx.rollout, **extras}, options)
    images, labels = ctx.local(ctx.decode(ctx.rollout.final)), [p["prompt"] for p in ctx.prompts_local]
    return {"credit_maps": overlay_grid(images, ctx.local(w), patch_size_of(ctx.rollout), labels)}


def overlay_grid(images, w, patch_size: int, labels=None, n: int = 12) -> dict:
    """`metrics.save_grid` kwargs: images [B, H, W, 3] in [-1, 1] over their token weights w [B, N] as a heat map."""
    images, w = np.asarray(images[:n], np.float32), np.asarray(w[:n], np.float32)
    b, h, wd, _ = images.shape
    g = (h // patch_size, wd // patch_size)
    maps = w.reshape(b, *g) / np.maximum(w.reshape(b, -1).max(1), 1e-8)[:, None, None]
    maps = np.kron(maps, np.ones((patch_size, patch_size)))[..., None]
    heat = np.concatenate([maps, maps * 0.6, 1 - maps], axis=-1) * 2 - 1  # blue (little) -> orange (much)
    overlay = 0.45 * images + 0.55 * heat
    return {"images": np.concatenate([images, overlay]), "rows": 2, "labels": list(labels[:n]) * 2 if labels else None,
            "row_titles": ["sample", "credit w"]}
