"""The trainable policy and what objectives may call on it.

    policy = Policy(dit, lora_rank)                      # the whole DiT (rank 0) or LoRA adapters
    trainable = policy.init(base_dit_params, rng)
    fns = policy_fns(policy, config.sampler, reward_apply, velocity_cfg)
    mean, std, v = fns.mean(policy.variables(trainable, base), mb)    # the rollout's kernel at mb["x"]

`PolicyFns` is the one interface every objective's loss gets (`objectives/__init__.py`): the kernel
mean for the reverse-process objectives, the (guided) velocity for the forward-process ones and
LeapAlign, and a differentiable reward for LeapAlign.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from flowrl_jax.models import lora
from flowrl_jax.models.mmdit import MMDiT
from flowrl_jax.sampling import kernels, rollout as rollout_lib


class Policy:
    """The trainable DiT: `variables(trainable, frozen_dit)` for `dit.apply`, with LoRA or without."""

    def __init__(self, dit: MMDiT, lora_rank: int, lora_init: str = "kaiming"):
        self.dit, self.lora_rank, self.lora_init = dit, lora_rank, lora_init

    def init(self, frozen_dit, rng):
        """LoRA adapters (float32), or the whole DiT as float32 master weights (the frozen copy may be bf16: a memory
        plan's `world.param_dtype`; Adam on bf16 weights loses updates below their ulp)."""
        if self.lora_rank:
            return lora.init_adapters(frozen_dit, rng, rank=self.lora_rank, targets=self.dit.lora_targets, init=self.lora_init)
        return jax.tree_util.tree_map(lambda p: p.astype(jnp.float32), frozen_dit)

    def variables(self, trainable, frozen_dit) -> dict:
        return {"params": frozen_dit, "lora": trainable} if self.lora_rank else {"params": trainable}

    def sampling_variables(self, trainable, frozen_dit) -> dict:
        """`dit.apply` variables for sampling without gradients: adapters merged once, not applied per step."""
        return {"params": self.merged(trainable, frozen_dit)}

    def merged(self, trainable, frozen_dit):
        """Plain DiT params (adapters folded in), in the frozen DiT's dtypes: what sampling, eval and export use."""
        if self.lora_rank:
            return lora.merge(frozen_dit, trainable, self.dit.lora_alpha)
        return jax.tree_util.tree_map(lambda t, f: t.astype(f.dtype), trainable, frozen_dit)

    def velocity_fn(self, dit_variables) -> Callable:
        """`(x, sigma [B], cond) -> v`, the form `sampling.rollout.guided` takes."""
        return lambda x, sigma, cond: self.dit.apply(dit_variables, x, sigma, *cond)


def kernel_mean_fn(policy: Policy, sampler_cfg, detach_uncond: bool = False) -> Callable:
    """`mean_fn(variables, mb) -> (mean, std, v)`: the rollout's kernel (with CFG) at the minibatch's states;
    `detach_uncond`: no gradient through CFG's unconditional branch (`rollout.guided`)."""

    def mean_fn(variables, mb):
        velocity = rollout_lib.guided(policy.velocity_fn(variables), mb["cond"], mb["null"], sampler_cfg.cfg, detach_uncond)
        return kernels.transition(sampler_cfg.kind, velocity, mb["x"], mb["sigma"], mb["sigma_next"], mb["level"], mb["sigma_1"])

    return mean_fn


class PolicyFns(NamedTuple):
    """What an objective may call (`objectives/__init__.py`)."""
    mean: Callable      # (variables, mb) -> (mean, std, v): the rollout's kernel at mb["x"] (kernel_mean_fn, the rollout's CFG)
    velocity: Callable  # (variables, x [M, H, W, C], sigma [M], mb) -> v with mb's condition, at CFG `velocity_cfg`
    reward: Callable    # (reward_params, images [M, H, W, C], mb) -> [M]: the world's differentiable reward (tokens in mb)


def policy_fns(policy: Policy, sampler_cfg, reward_apply: Callable | None = None, velocity_cfg: float | None = None,
               detach_uncond: bool = False) -> PolicyFns:
    """`velocity_cfg`: the CFG scale of `velocity` (None: the sampler's; 1: the conditional velocity alone);
    `detach_uncond`: `mean` and `velocity` take no gradient through CFG's unconditional branch."""
    cfg = sampler_cfg.cfg if velocity_cfg is None else velocity_cfg

    def velocity(variables, x, sigma, mb):
        return rollout_lib.guided(policy.velocity_fn(variables), mb["cond"], mb["null"], cfg, detach_uncond)(x, sigma)

    def reward(reward_params, images, mb):
        return reward_apply(reward_params, images, mb["reward_ids"], mb["reward_mask"])

    return PolicyFns(kernel_mean_fn(policy, sampler_cfg, detach_uncond), velocity, reward)
