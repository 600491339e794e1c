"""Objectives: `loss(variables, ref_variables, minibatch, mean_fn, options) -> (loss, aux)` by name.

`grpo`: the clipped ratio objective with a KL to the reference (Flow-GRPO, SPEC.md §4).
"""
from flowrl_jax.objectives import grpo

OBJECTIVES = {"grpo": grpo.clipped_loss}
