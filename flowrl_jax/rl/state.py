"""The train job's state: the typed `TrainState` the loop alone owns, its optimizer, and where it and the frozen weights live.

    frozen, frozen_shardings = place_frozen(plan, base)          # the world's base weights (+ the reward model's), sharded
    state, state_shardings = init_state(plan, policy, frozen)    # step 0, created already sharded on the mesh

`frozen = {"dit", "text", ...}` are the world's base weights (the KL reference and the frozen text encoder) and, when
the objective differentiates the world's reward model, `"reward"` (its params), all placed by the partition rules (a
credit scheme that differentiates it gets its own replicated copy: `programs.reward_gradient_fn`). The state is donated by the update (`programs.Programs.update`): only the value it returns is live.
"""
from __future__ import annotations

from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax

from flowrl_jax import keys, parallel
from flowrl_jax.data import curriculum
from flowrl_jax.rl.policy import Policy


@flax.struct.dataclass
class TrainState:
    step: jax.Array          # iterations done
    updates: jax.Array       # optimizer steps done (the update's randomness folds it in)
    params: Any              # the trainable: the whole DiT, or LoRA adapters (train.lora_rank > 0)
    ema: Any                 # EMA of params: what eval uses
    opt_state: Any           # optax state
    credit: dict             # the credit chain's state, one entry per scheme ({} when stateless)
    old: Any = None          # the old policy, for objectives with `old_policy` (else None)
    curriculum: Any = None   # per-prompt statistics when config.curriculum.enabled (else None)


LR_SCHEDULES = ("constant", "cosine")


def learning_rate(t_cfg) -> float | optax.Schedule:
    """`train.lr`, constant, or with `train.lr_schedule="cosine"` decayed along a cosine to a tenth of it over the
    run's optimizer steps (`iterations x num_inner_epochs x minibatches`; an upper bound where a credit scheme drops
    samples or `time_budget_s` stops the run early, which then ends above the tenth)."""
    if t_cfg.lr_schedule == "constant":
        return t_cfg.lr
    if t_cfg.lr_schedule == "cosine":
        total = max(1, t_cfg.iterations * t_cfg.num_inner_epochs * t_cfg.minibatches)
        return optax.cosine_decay_schedule(t_cfg.lr, total, alpha=0.1)
    raise ValueError(f"train.lr_schedule={t_cfg.lr_schedule!r} is not a schedule: choose one of {', '.join(LR_SCHEDULES)}")


def make_optimizer(t_cfg) -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(t_cfg.grad_clip),
                       optax.adamw(learning_rate(t_cfg), b1=0.9, b2=0.999, weight_decay=t_cfg.weight_decay))


def initial_state(policy: Policy, optimizer, credit, objective, config, num_prompts: int, frozen_dit, rng) -> TrainState:
    """The TrainState at step 0: the policy's trainable params (and their EMA, optimizer state, old policy) from `rng`."""
    params = policy.init(frozen_dit, rng)
    return TrainState(step=jnp.zeros((), jnp.int32), updates=jnp.zeros((), jnp.int32), params=params, ema=params,
                      opt_state=optimizer.init(params), credit=credit.init(), old=params if objective.old_policy is not None else None,
                      curriculum=jax.tree_util.tree_map(jnp.asarray, curriculum.init(num_prompts)) if config.curriculum.enabled else None)


def place_frozen(plan, base: dict, reward_params: Any = None) -> tuple[dict, Any]:
    """-> (frozen, its shardings): `base` (host) and, when given, the reward model's params under "reward", placed on
    the plan's mesh by the partition rules."""
    tree = base if reward_params is None else {**base, "reward": reward_params}
    shardings = parallel.tree_shardings(tree, plan.mesh, plan.config.partition_rules, plan.config.min_fsdp_size)
    return parallel.put_global(tree, shardings), shardings


def init_state(plan, policy: Policy, frozen: dict, initial: Any = None) -> tuple[TrainState, Any]:
    """-> (the TrainState at step 0, created sharded by the partition rules, its shardings). Its randomness is
    `keys.device(seed, "init")`. `initial`: host params the policy starts from instead (an imported LoRA), placed as the
    params, their EMA and the old policy (the optimizer's state starts at zeros either way)."""
    config = plan.config
    build = lambda rng: initial_state(policy, plan.optimizer, plan.credit, plan.objective, config,  # noqa: E731
                                      len(plan.world.train_prompts), frozen["dit"], rng)
    rng = keys.device(config.seed, "init")
    shardings = parallel.tree_shardings(jax.eval_shape(build, rng), plan.mesh, config.partition_rules, config.min_fsdp_size)
    state = jax.jit(build, out_shardings=shardings)(rng)
    if initial is not None:
        place = lambda: parallel.put_global(initial, shardings.params)  # noqa: E731 (three buffers: the update donates the state)
        state = state.replace(params=place(), ema=place(), old=place() if state.old is not None else None)
    return state, shardings


def update_old_policy(state: TrainState, decay: Callable) -> TrainState:
    """The old policy after an iteration: `old <- d old + (1 - d) params`, `d = decay(updates)`, the optimizer steps
    done, as DiffusionNFT's `return_decay(global_step)` counts them (objectives/__init__.py)."""
    d = decay(state.updates.astype(jnp.float32))
    return state.replace(old=jax.tree_util.tree_map(lambda o, p: d * o + (1 - d) * p, state.old, state.params))
