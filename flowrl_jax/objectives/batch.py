"""What an objective reads: one iteration's data on the device, a minibatch of its training pairs, the parameter trees.

    data = IterationData(rollout, schedule, adv, cond, null, key)     # + the reward model's tokens when the objective asks
    mb = objective.pairs(data, rows, slots, weight, key, options)     # Minibatch: its per-pair and shared parts
    loss, aux = objective.loss(trees, mb, fns, options)               # trees: ParamTrees; fns: rl.policy.PolicyFns

A pair is (sample `rows[m]`, slot `slots[m]`) with `weight[m]` (0 on padding). `Minibatch.pairs` holds the arrays with a
leading pair axis `[M, ...]` (sharded like the batch by the update), `Minibatch.shared` those without one (the schedule,
the batch's advantage floor): the update shards one part and leaves the other whole, with no list of names to keep.
`mb[name]` reads either part.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import flax.struct
import jax

from flowrl_jax.sampling.rollout import Rollout, Schedule


@flax.struct.dataclass
class IterationData:
    """The iteration on the device, everything global and batch-leading but the schedule and the key."""
    rollout: Rollout
    schedule: Schedule
    adv: jax.Array                       # [B, T or 1, K] the credit chain's advantages (K = 1 or N tokens)
    cond: Any                            # the DiT's conditioning of the B rows (a batch-leading pytree)
    null: Any                            # the CFG null condition, B rows
    key: jax.Array                       # the iteration's own randomness (forward-process times)
    reward_ids: jax.Array | None = None  # [B, L] the reward model's tokens (objectives with `uses_reward_model`)
    reward_mask: jax.Array | None = None


@flax.struct.dataclass
class Minibatch:
    pairs: dict                                              # {name: [M, ...]}
    shared: dict = flax.struct.field(default_factory=dict)   # {name: array without a pair axis}

    def __getitem__(self, name: str):
        return self.pairs[name] if name in self.pairs else self.shared[name]

    def __contains__(self, name: str) -> bool:
        return name in self.pairs or name in self.shared


class ParamTrees(NamedTuple):
    """The parameter trees a loss may use, each `dit.apply` variables but `reward`."""
    policy: dict             # the policy being trained (its gradient is the update's)
    reference: dict          # the frozen base model: the KL reference
    old: dict | None = None  # the old policy (objectives with `old_policy`), else None
    reward: Any = None       # the world's reward model's params (objectives with `uses_reward_model`), else None
