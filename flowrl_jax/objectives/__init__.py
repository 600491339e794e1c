"""Objectives: `loss(variables, ref_variables, minibatch, mean_fn, options) -> (loss, aux)` by name.

`grpo`: the clipped ratio objective with a KL to the reference (Flow-GRPO, SPEC.md §4).
`lambda_grpo`: the same with lambda control (calibrated ratio, effort weights, path-variance budget).
"""
from flowrl_jax.objectives import grpo

OBJECTIVES = {"grpo": grpo.clipped_loss, "lambda_grpo": grpo.lambda_loss}
