"""Objectives by name: `Objective(loss, process, kinds, old_policy)`, `loss(variables, ref_variables, mb, fn, options) -> (loss, aux)`.

The process says which minibatches the shared train loop builds and what `fn` is:
- `reverse`: (sample, SDE step) pairs of an sde/cps/lc rollout (`grpo.gather_pairs`); `fn` = the
  kernel mean `(variables, mb) -> (mean, std, v)`. `grpo` (Flow-GRPO's clipped ratio, SPEC §4) and
  `lambda_grpo` (lambda control).
- `forward`: (sample, time slot) pairs of the final samples noised afresh (`forward.forward_pairs`);
  `fn` = `train.PolicyFns` (its `velocity`). `advantage_flow` and `nft` (SPEC §6).
- `leap`: one pair per sample of an ODE rollout (`leap.leap_pairs`); `fn` = `train.PolicyFns` (its
  `velocity` and the learned `reward`). `leapalign` (SPEC §6).
`old_policy`: when set, the TrainState keeps `theta_old`, which draws the rollouts and follows the
policy after each iteration by `old <- d old + (1 - d) theta`, `d = old_policy(step)`: DiffusionNFT's
EMA schedule, or `d = 0` for AdvantageFlow (its anchor is the rollout policy's velocity).
"""
from typing import Callable, NamedTuple

from flowrl_jax.objectives import advantage_flow, grpo, leap, nft


class Objective(NamedTuple):
    loss: Callable
    process: str                 # "reverse" | "forward" | "leap"
    kinds: tuple[str, ...]       # sampler kinds its rollouts may use
    old_policy: Callable | None = None   # step -> decay d


OBJECTIVES = {
    "grpo": Objective(grpo.clipped_loss, "reverse", ("sde", "cps", "lc")),
    "lambda_grpo": Objective(grpo.lambda_loss, "reverse", ("sde", "cps")),
    "advantage_flow": Objective(advantage_flow.loss, "forward", ("ode", "sde", "cps", "lc"), advantage_flow.rollout_policy_decay),
    "nft": Objective(nft.loss, "forward", ("ode",), nft.old_policy_decay),
    "leapalign": Objective(leap.loss, "leap", ("ode",)),
}
