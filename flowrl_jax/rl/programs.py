"""The jitted programs of one RL iteration on the plan's mesh: a typed record built by one function, holding no state.

    programs, frozen, state = build(plan, dit, base)      # the policy, the frozen weights placed, step 0, the programs
    ro, cond, null = programs.rollout(state.params, frozen, ids, mask, rng, levels)       # per-row Rollout, batch sharded
    adv, credit_state, keep = programs.credit(ro, schedule, rewards, group_ids, num_groups, state.credit, extras, key)
    state, stats = programs.update(state, frozen, data, rows, slots, weight)   # one optimizer step; donates `state`

`data` is the iteration's `objectives.batch.IterationData`; the objective builds its own training pairs from it
(`objectives/__init__.py`). The loop owns the state: each program that changes it takes it and returns the new one,
and the update donates the buffers it was given. Everything random inside the update derives from `config.seed` and
the update counter (`keys.device(seed, "update", u)`), so a resumed run equals an uninterrupted one.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from flowrl_jax import compiler, credit as credit_lib, keys, parallel
from flowrl_jax.config_lib import ConfigError
from flowrl_jax.credit.context import Context
from flowrl_jax.models import lora_files
from flowrl_jax.objectives.batch import IterationData, ParamTrees
from flowrl_jax.rl.policy import Policy, policy_fns
from flowrl_jax.rl.state import TrainState, init_state, place_frozen, update_old_policy
from flowrl_jax.sampling import rollout as rollout_lib, schedule, windows


def schedule_of(sampler_cfg, levels) -> rollout_lib.Schedule:
    """The `Schedule` of a rollout drawn at `levels [T]` (an iteration's SDE window) on the config's sigmas."""
    return rollout_lib.Schedule(schedule.sigmas(sampler_cfg.num_steps, sampler_cfg.shift, sampler_cfg.grid), jnp.asarray(levels, jnp.float32))


class RolloutProgram(NamedTuple):
    """An iteration's rollout, `chunks` chunks of rows at a time (`train.rollout_chunk` rows each; one chunk without it),
    every chunk sampled by the same `chunk` function: inside one program (`whole`), or one call per chunk from the host
    (`start`, `chunk`, `assemble`), so that the loop can score chunk i while chunk i + 1 samples. Chunk i's rows are
    `parallel.to_row_chunks`' chunk i (every chunk spans every batch shard). The initial noise is the whole batch's
    either way; the step noise of chunk i comes from `fold_in(key, i)`, so a chunked rollout is another draw of the
    same process. The outputs' rows are sharded like the batch, not left to the compiler."""
    whole: Callable     # (trainable, frozen, ids, mask, rng, levels [T]) -> (Rollout, cond, null)
    start: Callable     # (ids, mask, rng) -> ([chunk i's (ids, mask, x_T)], the steps' key)
    chunk: Callable     # (trainable, frozen, chunk inputs, chunk key, levels) -> its (Rollout, cond, null); `chunk_key`
    assemble: Callable  # [chunk i's (Rollout, cond, null)] -> the batch's, rows in order
    chunks: int

    def __call__(self, trainable, frozen, ids, mask, rng, levels, on_chunk: Callable | None = None):
        """-> (Rollout, cond, null); with `on_chunk`, chunk by chunk from the host, `on_chunk(i, chunk i's outputs)` as soon
        as chunk i is dispatched (its rows: `parallel.to_row_chunks`' chunk i)."""
        if on_chunk is None:
            return self.whole(trainable, frozen, ids, mask, rng, levels)
        pieces, k_steps = self.start(ids, mask, rng)
        outs = []
        for i, rows in enumerate(pieces):
            outs.append(self.chunk(trainable, frozen, rows, chunk_key(k_steps, i, len(pieces)), levels))
            on_chunk(i, outs[-1])
        return self.assemble(outs)


def chunk_key(k_steps, i, chunks: int):
    """The step noise's key of chunk `i` of `chunks`: `fold_in(k_steps, i)`, or `k_steps` itself for a whole batch."""
    return jax.random.fold_in(k_steps, i) if chunks > 1 else k_steps


def num_chunks(rows: int, rollout_chunk: int) -> int:
    """How many chunks of `train.rollout_chunk` rows a batch of `rows` is sampled in (1 without chunking)."""
    return rows // rollout_chunk if 0 < rollout_chunk < rows else 1


def make_rollout(policy: Policy, world, config, row_sharding: jax.sharding.NamedSharding | None = None) -> RolloutProgram:
    """The rollout's functions, jit-able (`RolloutProgram`); `row_sharding`: the batch's."""
    s, t = config.sampler, config.train
    sigmas = schedule.sigmas(s.num_steps, s.shift, s.grid)
    tail = windows.tail(s)
    chunks = num_chunks(t.prompts_per_iteration * t.group_size, t.get("rollout_chunk", 0))  # of an iteration's batch
    shards = parallel.batch_shards(row_sharding.mesh) if row_sharding is not None else 1

    def noise(ids, rng):  # -> (x_T [B, ...], the steps' key): the whole batch's initial noise, chunked or not
        k_noise, k_steps = jax.random.split(rng)
        return rollout_lib.initial_noise(k_noise, world.latent_shape(ids.shape[0]), t.group_size, s.same_noise_per_group), k_steps

    def chunk(trainable, frozen, rows, key, levels):
        ids, mask, x_T = rows
        cond = world.encode(frozen, ids, mask)
        null = world.null_condition(frozen, ids.shape[0])
        velocity = rollout_lib.guided(policy.velocity_fn(policy.sampling_variables(trainable, frozen["dit"])), cond, null, s.cfg)
        ro = rollout_lib.rollout(velocity, x_T, sigmas, levels, key, s.kind, policy.dit.token_patch, s.logprob_form, **tail)
        return ro, cond, null

    def rollout_fn(trainable, frozen, ids, mask, rng, levels):  # the name profiles show (jit_rollout_fn)
        x_T, k_steps = noise(ids, rng)
        b = ids.shape[0]
        n = num_chunks(b, t.get("rollout_chunk", 0))
        if n == 1:
            return parallel.constrain_rows(chunk(trainable, frozen, (ids, mask, x_T), k_steps, levels), row_sharding, b)
        out = parallel.map_row_chunks(lambda i, rows: chunk(trainable, frozen, rows, chunk_key(k_steps, i, n), levels),
                                      (ids, mask, x_T), n, shards, row_sharding)
        return parallel.constrain_rows(out, row_sharding, b)

    def start(ids, mask, rng):
        x_T, k_steps = noise(ids, rng)
        pieces = jax.tree_util.tree_map(lambda a: parallel.to_row_chunks(a, chunks, shards), (ids, mask, x_T))
        return [jax.tree_util.tree_map(lambda a: a[i], pieces) for i in range(chunks)], k_steps

    def assemble(outs):
        rows = jax.tree_util.tree_map(lambda *parts: parallel.from_row_chunks(parts, shards), *outs)
        return parallel.constrain_rows(rows, row_sharding, rows[0].final.shape[0])

    return RolloutProgram(rollout_fn, start, chunk, assemble, chunks)


def make_completion_fn(policy: Policy, config) -> Callable:
    """jit-able `(trainable, frozen, cond, null, states [B, m, H, W, C], steps) -> [B, m, H, W, C]`: the
    ODE sampler (CFG) from each state to sigma = 0 (`sampling.rollout.complete`); `steps` is static."""
    s = config.sampler
    sigmas = schedule.sigmas(s.num_steps, s.shift, s.grid)

    def complete(trainable, frozen, cond, null, states, steps):
        velocity_fn = policy.velocity_fn(policy.sampling_variables(trainable, frozen["dit"]))
        return rollout_lib.complete(lambda repeat: rollout_lib.guided(velocity_fn, repeat(cond), repeat(null), s.cfg),
                                    states, steps, sigmas)

    return complete


def make_credit_fn(credit, drops_zero_advantage: bool, null_control: bool = False) -> Callable:
    """`(ro, schedule, rewards, group_ids, num_groups, credit_state, extras, key) -> (A, credit_state, keep [B])`; objectives
    with per-step ratios drop samples with no advantage on a trained step (docs/math.md §2), the others keep all.
    `null_control` (`config.advantage.null_control`): the chain's advantages `A[b, t, k]` are then shuffled
    between the samples of each group (`key`), so the run trains on the same advantage values attached to
    the wrong samples: its expected policy gradient is zero, and what such a run does is drift, not learning."""
    def credit_fn(ro, sched, rewards, group_ids, num_groups, credit_state, extras, key):
        inputs = {"rollout": ro, "schedule": sched, "rewards": rewards, "group_ids": group_ids, "num_groups": num_groups, **extras}
        adv, credit_state = credit.apply(inputs, credit_state)
        if null_control:
            adv = credit_lib.group.permute_within_groups(adv, group_ids, key)
        keep = credit_lib.kept_samples(adv, sched.trained) if drops_zero_advantage else jnp.ones(rewards.shape, bool)
        return adv, credit_state, keep

    return credit_fn


def make_update_fn(policy: Policy, objective, options, optimizer, config, reward_apply: Callable | None = None,
                   pair_sharding: jax.sharding.NamedSharding | None = None) -> Callable:
    """jit-able `(state, frozen, data, rows, slots, weight) -> (state, stats)`: one optimizer step of the
    objective on its pairs `(rows[m], slots[m])` of the iteration's `data` (`IterationData`).

    `train.microbatch` (pairs per forward/backward, 0 = the whole minibatch): the minibatch's M pairs run
    `microbatch` at a time in a `lax.scan` that sums each microbatch's gradient times its share of the weight,
    `W_j / W`, then one optimizer step (the memory plan's update knob). For losses that are weighted means
    over pairs (grpo, nft, advantage_flow) this is the whole minibatch's gradient; a statistic over the whole
    minibatch becomes one per microbatch (lambda control's per-step budget test, LeapAlign's softmax), and the
    reported stats are the weight-share means of the microbatches' (exact for the loss and weighted means).
    The objective's randomness is `key` unsplit, or `fold_in(key, j)` for microbatch j. `pair_sharding`: the
    pairs' sharding (the batch axes), imposed on the minibatch's per-pair part so every device computes its own pairs."""
    fns = policy_fns(policy, config.sampler, reward_apply, options.get("train_cfg", 0.0) or None, options.get("detach_uncond", False))
    ema_decay, ema_every = config.train.ema_decay, config.train.ema_every
    microbatch = config.train.get("microbatch", 0)

    def value_and_grad(state: TrainState, frozen, data, rows, slots, weight, key):
        mb = objective.pairs(data, rows, slots, weight, key, options)
        mb = mb.replace(pairs=parallel.constrain_rows(mb.pairs, pair_sharding, rows.shape[0]))
        old = policy.variables(state.old, frozen["dit"]) if objective.old_policy is not None else None
        reward = frozen["reward"] if objective.uses_reward_model else None

        def loss(trainable):
            trees = ParamTrees(policy.variables(trainable, frozen["dit"]), {"params": frozen["dit"]}, old, reward)
            return objective.loss(trees, mb, fns, options)

        return jax.value_and_grad(loss, has_aux=True)(state.params)

    def accumulated(state, frozen, data, rows, slots, weight, key):
        m = rows.shape[0]
        if not microbatch or microbatch >= m:
            return value_and_grad(state, frozen, data, rows, slots, weight, key)
        if m % microbatch:  # the loop's minibatches are whole microbatches (`minibatch.minibatch_pairs`); a direct call may not be
            raise ValueError(f"train.microbatch={microbatch} must divide the minibatch's {m} pairs")
        total = jnp.maximum(weight.sum(), 1e-8)

        def body(acc, inputs):
            j, rows_j, slots_j, weight_j = inputs
            out = value_and_grad(state, frozen, data, rows_j, slots_j, weight_j, jax.random.fold_in(key, j))
            share = weight_j.sum() / total
            return jax.tree_util.tree_map(lambda a, x: (a + share * x).astype(a.dtype), acc, out), None

        chunks = (jnp.arange(m // microbatch),) + tuple(a.reshape(m // microbatch, microbatch) for a in (rows, slots, weight))
        shapes = jax.eval_shape(lambda: value_and_grad(state, frozen, data, *(a[0] for a in chunks[1:]), key))
        zeros = jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
        return jax.lax.scan(body, zeros, chunks)[0]

    def update(state: TrainState, frozen, data: IterationData, rows, slots, weight):
        key = keys.device(config.seed, "update", state.updates)  # microbatch j: fold_in(key, j), the update stream's own
        (value, aux), grads = accumulated(state, frozen, data, rows, slots, weight, key)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        n = state.updates + 1
        decay = jnp.where(n % ema_every == 0, jnp.minimum(ema_decay, (1.0 + n) / (10.0 + n)), 1.0)  # every ema_every updates
        ema = jax.tree_util.tree_map(lambda e, p: decay * e + (1 - decay) * p, state.ema, params)
        stats = {"loss": value, **aux, "grad_norm": optax.tree.norm(grads), "update_norm": optax.tree.norm(updates),
                 "param_norm": optax.tree.norm(params)}
        return state.replace(params=params, opt_state=opt_state, ema=ema, updates=n), stats

    return update


def make_image_change_fn(policy: Policy, world, config) -> Callable:
    """jit-able `(before, after, frozen, ids, mask, rng, levels [T]) -> {total, trained_steps, untrained_steps}`: how far an
    update moved the final latents of the first `config.diagnostics.image_change_samples` prompts, at the same
    noise (RMS over elements): with `after` on every step (total), on the trained (SDE-window) steps only
    with `before` elsewhere, and the rest (`after` everywhere against `after` on the trained steps only)."""
    s, t = config.sampler, config.train
    n = min(config.diagnostics.image_change_samples, t.prompts_per_iteration * t.group_size)
    sigmas = schedule.sigmas(s.num_steps, s.shift, s.grid)
    tail = windows.tail(s)

    def image_change(before, after, frozen, ids, mask, rng, levels):
        cond = world.encode(frozen, ids[:n], mask[:n])
        null = world.null_condition(frozen, n)
        v_before, v_after = (rollout_lib.guided(policy.velocity_fn(policy.sampling_variables(p, frozen["dit"])), cond, null, s.cfg)
                             for p in (before, after))

        def v_mixed(x, sigma):  # `after` on the trained steps, `before` on the others
            on_trained = jnp.any((sigmas[:-1] == jnp.ravel(sigma)[0]) & (levels > 0))
            return jax.lax.cond(on_trained, v_after, v_before, x, sigma)

        k_noise, k_steps = jax.random.split(rng)
        x_T = jax.random.normal(k_noise, world.latent_shape(n))
        final = [rollout_lib.rollout(v, x_T, sigmas, levels, k_steps, s.kind, policy.dit.token_patch, s.logprob_form, **tail).final
                 for v in (v_before, v_after, v_mixed)]
        rms = lambda a: jnp.sqrt(jnp.mean(jnp.square(a)))  # noqa: E731
        return {"total": rms(final[1] - final[0]), "trained_steps": rms(final[2] - final[0]), "untrained_steps": rms(final[1] - final[2])}

    return image_change


def reward_gradient_fn(reward_model, mesh) -> Callable:
    """`(x [B, H, W, C], prompt rows) -> d R / d x` of the world's reward model (jit), its params replicated
    on `mesh` and the prompt tokens sharded like the batch."""
    apply, params, tokenize = reward_model
    params = parallel.put_global(params, jax.tree_util.tree_map(lambda _: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()), params))
    grad = jax.jit(jax.grad(lambda x, p, i, m: apply(p, x, i, m).sum()))
    return lambda x, prompts: grad(x, params, *parallel.shard_batch(tokenize(prompts), mesh))


class Programs(NamedTuple):
    """The jitted programs of one run (module doc) and the policy they run; built by `compile_programs`."""
    policy: Policy
    state_shardings: Any                 # the TrainState's shardings (what a host-side change is placed by)
    rollout: RolloutProgram
    credit: Callable                     # num_groups (argument 4) static
    complete: Callable                   # `steps` (argument 5) static
    image_change: Callable
    update: Callable                     # donates its state
    update_old_policy: Callable | None   # objectives with an old policy, else None
    reward_gradient: Callable | None     # credit schemes that differentiate the reward model, else None
    reward_tokens: Callable | None       # objectives that do: host prompt rows -> (ids, mask) batch-sharded, else None


def compile_programs(plan, policy: Policy, frozen_shardings, state_shardings, reward_model=None) -> Programs:
    """Every program of an iteration, jitted with the plan's shardings (compiled at their first call); `reward_model`:
    the world's (`worlds.RewardModel`), when the plan uses it."""
    config, mesh = plan.config, plan.mesh
    options = plan.loss_options(policy.dit.token_patch)
    data, replicated = parallel.batch_sharding(mesh), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    pieces = make_rollout(policy, plan.world, config, data)
    rollout = RolloutProgram(
        whole=jax.jit(pieces.whole, in_shardings=(state_shardings.params, frozen_shardings, data, data, replicated, replicated)),
        start=jax.jit(pieces.start, in_shardings=(data, data, replicated), out_shardings=([data] * pieces.chunks, replicated)),
        chunk=jax.jit(pieces.chunk, in_shardings=(state_shardings.params, frozen_shardings, data, replicated, replicated),
                      out_shardings=data),
        assemble=jax.jit(pieces.assemble), chunks=pieces.chunks)
    objective = plan.objective
    uses_reward = objective.uses_reward_model
    update = jax.jit(make_update_fn(policy, objective, options, plan.optimizer, config, reward_model.apply if uses_reward else None, data),
                     out_shardings=(state_shardings, None), donate_argnums=0, compiler_options=compiler.backward_options())
    old = None
    if objective.old_policy is not None:
        old = jax.jit(functools.partial(update_old_policy, decay=lambda step: objective.old_policy(step, options)),
                      out_shardings=state_shardings, donate_argnums=0)
    reward_tokens = None
    if uses_reward:
        reward_tokens = lambda prompts: parallel.shard_batch(reward_model.tokenize(prompts), mesh)  # noqa: E731
    return Programs(
        policy=policy, state_shardings=state_shardings, rollout=rollout,
        credit=jax.jit(make_credit_fn(plan.credit, "step" in objective.offers(options), config.advantage.null_control), static_argnums=4),
        complete=jax.jit(make_completion_fn(policy, config), static_argnums=5),
        image_change=jax.jit(make_image_change_fn(policy, plan.world, config)),
        update=update, update_old_policy=old,
        reward_gradient=reward_gradient_fn(reward_model, mesh) if plan.credit.uses_reward_model else None,
        reward_tokens=reward_tokens)


def imported_lora(config, policy: Policy, base_dit) -> dict | None:
    """The adapters a run starts from when `config.policy.lora` names a LoRA trained elsewhere (a flow_grpo PEFT adapter
    folder or a diffusers LoRA file: `models/lora_files.py`), rescaled to the DiT's `lora_alpha`; None otherwise. It must
    adapt exactly the modules `train.lora_rank`'s adapters would (flow_grpo's eight attention projections), at that rank."""
    path = config.get("policy", {}).get("lora", "")
    if not path:
        return None
    if not policy.lora_rank:
        raise ConfigError(f"config.policy.lora={path!r} starts a LoRA run: set --config.train.lora_rank to its rank")
    try:
        adapters, alpha = lora_files.read_lora(path, base_dit)
    except (lora_files.LoraFileError, FileNotFoundError) as e:
        raise ConfigError(f"config.policy.lora: {e}") from None
    rank, ours = lora_files.rank_of(adapters), policy.init(base_dit, jax.random.PRNGKey(0))
    if rank != policy.lora_rank:
        raise ConfigError(f"config.policy.lora has rank {rank} and train.lora_rank={policy.lora_rank}: pass --config.train.lora_rank={rank}")
    if jax.tree_util.tree_structure(adapters) != jax.tree_util.tree_structure(ours):
        theirs, mine = (set(lora_files.target_modules(x, base_dit)) for x in (adapters, ours))
        raise ConfigError(f"config.policy.lora adapts {sorted(theirs)}, a run trains adapters on {sorted(mine)}: a LoRA of "
                          "other modules can be sampled and evaluated (policy.lora), not trained on")
    return lora_files.rescaled(adapters, alpha, policy.dit.lora_alpha)


def build(plan, dit, base: dict) -> tuple[Programs, dict, TrainState]:
    """-> (programs, frozen, the step-0 state): the policy, the base weights placed (with the reward model's when the
    objective differentiates it), the state created sharded, and the programs; what the train job's setup builds."""
    t = plan.config.train
    policy = Policy(dit, t.lora_rank, t.lora_init)
    reward_model = plan.world.reward_model() if plan.uses_reward_model else None
    frozen, frozen_shardings = place_frozen(plan, base, reward_model.params if plan.objective.uses_reward_model else None)
    state, state_shardings = init_state(plan, policy, frozen, imported_lora(plan.config, policy, base["dit"]))
    return compile_programs(plan, policy, frozen_shardings, state_shardings, reward_model), frozen, state


def iteration_data(programs: Programs, ro, sched, adv, cond, null, key, prompts_local: list[dict]) -> IterationData:
    """The update's view of an iteration (`IterationData`), with the reward model's tokens when the objective asks."""
    ids, mask = programs.reward_tokens(prompts_local) if programs.reward_tokens is not None else (None, None)
    return IterationData(ro, sched, adv, cond, null, key, ids, mask)


def credit_context(programs: Programs, world, mesh, frozen: dict, params, ro, sched, cond, null, prompts_local: list[dict],
                   reward_fn: Callable) -> Context:
    """The credit schemes' host-side tools for this iteration (`credit.context`); `params`: the policy the rollout drew."""
    def complete(states, steps):
        return programs.complete(params, frozen, cond, null, states, tuple(int(t) for t in steps))

    return Context(ro, sched, prompts_local, reward_fn, mesh, complete, programs.reward_gradient, lambda x: world.decode(frozen, x))
