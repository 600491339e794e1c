"""The jit-compiled pieces of one RL iteration on a mesh, and the typed TrainState.

    steps = Steps(config, mesh, world, dit, base, credit, num_prompts)
    ro, cond, null = steps.rollout(state.params, steps.frozen, ids, mask, rng)     # batch sharded on the mesh
    adv, credit_state, keep = steps.credit(ro, rewards, group_ids, num_groups, state.credit, extras, key)
    state, stats = steps.update(state, steps.frozen, data, rows, slots, weight)    # one optimizer step

`frozen = {"dit", "text", ...}` are the world's base weights (the KL reference and the frozen text
encoder) and, for an objective that differentiates the reward model, `"reward"` (its params), all
sharded by the partition rules. `data = {"rollout", "adv", "cond", "null", **objective extras}`; the
objective builds its own training pairs from it (`objectives/__init__.py`). Everything random inside
the update derives from `config.seed` and the update counter, so a resumed run equals an uninterrupted one.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from flowrl_jax import compiler, credit as credit_lib, objectives, parallel
from flowrl_jax.credit.context import Context
from flowrl_jax.data import curriculum
from flowrl_jax.rl.policy import Policy, policy_fns
from flowrl_jax.sampling import rollout as rollout_lib, schedule, windows


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


def sampler_levels(sampler_cfg, window: tuple[int, int] | None = None) -> jax.Array:
    """[T] noise level per step from `config.sampler`: its SDE window (`()` = every step), or `window` (start, size),
    the window of an iteration (`sampling.windows.window_at`)."""
    levels = rollout_lib.noise_levels(sampler_cfg.num_steps, sampler_cfg.noise_level, window or windows.base_window(sampler_cfg))
    return levels * 0.0 if sampler_cfg.kind == "ode" else levels


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


def make_rollout_fn(policy: Policy, world, config, row_sharding: jax.sharding.NamedSharding | None = None) -> Callable:
    """jit-able `(trainable, frozen, ids, mask, rng, levels=None) -> (Rollout, cond, null)`; `levels [T]`: the iteration's
    noise level per step (its SDE window, `Steps.levels_at`), None = the config's fixed window. With `train.rollout_chunk`
    (rows per chunk, 0 = all) the rows are sampled `rollout_chunk` at a time (`parallel.map_row_chunks`: each chunk
    spans the batch shards of `row_sharding`, its outputs are written in place), so the activations held at once
    are one chunk's: the memory plan's rollout knob. The initial noise is the whole batch's either way; the step
    noise of chunk `i` comes from `fold_in(key, i)`, so a chunked rollout is another draw of the same process.
    The outputs' rows are sharded like the batch (`row_sharding`), not left to the compiler."""
    s, t = config.sampler, config.train
    sigmas = schedule.sigmas(s.num_steps, s.shift)
    levels = sampler_levels(s)
    tail = windows.tail(s)
    chunk = t.get("rollout_chunk", 0)
    shards = parallel.batch_shards(row_sharding.mesh) if row_sharding is not None else 1

    def rows_rollout(trainable, frozen, ids, mask, x_T, key, levels):
        cond = world.encode(frozen, ids, mask)
        null = world.null_condition(frozen, ids.shape[0])
        velocity = rollout_lib.guided(policy.velocity_fn(policy.sampling_variables(trainable, frozen["dit"])), cond, null, s.cfg)
        ro = rollout_lib.rollout(velocity, x_T, sigmas, levels, key, s.kind, policy.dit.patch_size, s.logprob_form, **tail)
        return ro, cond, null

    def noise(ids, rng):  # -> (x_T [B, ...], the steps' key): the whole batch's initial noise either way
        k_noise, k_steps = jax.random.split(rng)
        return rollout_lib.initial_noise(k_noise, world.latent_shape(ids.shape[0]), t.group_size, s.same_noise_per_group), k_steps

    def one(trainable, frozen, rows, k_steps, i, levels=levels):  # chunk i's rollout, its per-row parts only
        ids_c, mask_c, x_c = rows
        ro, cond, null = rows_rollout(trainable, frozen, ids_c, mask_c, x_c, jax.random.fold_in(k_steps, i), levels)
        return ro.replace(sigmas=None, noise_levels=None), cond, null

    def rollout_fn(trainable, frozen, ids, mask, rng, levels=levels):
        x_T, k_steps = noise(ids, rng)
        if not chunk or chunk >= ids.shape[0]:
            return parallel.constrain_rows(rows_rollout(trainable, frozen, ids, mask, x_T, k_steps, levels), row_sharding, ids.shape[0])
        out = parallel.map_row_chunks(lambda i, rows: one(trainable, frozen, rows, k_steps, i, levels), (ids, mask, x_T),
                                      ids.shape[0] // chunk, shards, row_sharding)
        ro, cond, null = parallel.constrain_rows(out, row_sharding, ids.shape[0])
        return ro.replace(sigmas=sigmas, noise_levels=levels), cond, null

    # The same chunks, one jitted call each from the host (`Steps.rollout_in_chunks`): the loop can score chunk i while
    # chunk i + 1 samples. `start` cuts the inputs into chunks (`to_row_chunks`), `one` samples one, `assemble` puts
    # the chunks' outputs back in row order.
    def start(ids, mask, rng):
        x_T, k_steps = noise(ids, rng)
        pieces = jax.tree_util.tree_map(lambda a: parallel.to_row_chunks(a, ids.shape[0] // chunk, shards), (ids, mask, x_T))
        return [jax.tree_util.tree_map(lambda a: a[i], pieces) for i in range(ids.shape[0] // chunk)], k_steps

    def assemble(outs, levels=levels):
        rows = jax.tree_util.tree_map(lambda *chunks: parallel.from_row_chunks(chunks, shards), *outs)
        ro, cond, null = parallel.constrain_rows(rows, row_sharding, rows[0].final.shape[0])
        return ro.replace(sigmas=sigmas, noise_levels=levels), cond, null

    rollout_fn.start, rollout_fn.chunk, rollout_fn.assemble = start, one, assemble
    return rollout_fn


def make_completion_fn(policy: Policy, config) -> Callable:
    """jit-able `(trainable, frozen, cond, null, states [B, m, H, W, C], steps) -> [B, m, H, W, C]`: the
    ODE sampler (CFG) from each state to sigma = 0 (`sampling.rollout.complete`); `steps` is static."""
    s = config.sampler
    sigmas = schedule.sigmas(s.num_steps, s.shift)

    def complete(trainable, frozen, cond, null, states, steps):
        velocity_fn = policy.velocity_fn(policy.sampling_variables(trainable, frozen["dit"]))
        return rollout_lib.complete(lambda repeat: rollout_lib.guided(velocity_fn, repeat(cond), repeat(null), s.cfg),
                                    states, steps, sigmas)

    return complete


def make_credit_fn(credit, drops_zero_advantage: bool, null_control: bool = False) -> Callable:
    """`(ro, rewards, group_ids, num_groups, credit_state, extras, key) -> (A, credit_state, keep [B])`; objectives
    with per-step ratios drop samples with no advantage on a trained step (SPEC §2), the others keep all.
    `null_control` (`config.advantage.null_control`): the chain's advantages `A[b, t, k]` are then shuffled
    between the samples of each group (`key`), so the run trains on the same advantage values attached to
    the wrong samples: its expected policy gradient is zero, and what such a run does is drift, not learning."""
    def credit_fn(ro, rewards, group_ids, num_groups, credit_state, extras, key):
        inputs = {"rollout": ro, "rewards": rewards, "group_ids": group_ids, "num_groups": num_groups, **extras}
        adv, credit_state = credit.apply(inputs, credit_state)
        if null_control:
            adv = credit_lib.group.permute_within_groups(adv, group_ids, key)
        keep = credit_lib.kept_samples(adv, ro.trained) if drops_zero_advantage else jnp.ones(rewards.shape, bool)
        return adv, credit_state, keep

    return credit_fn


SHARED_PAIR_FIELDS = ("all_sigmas", "all_levels", "sigma_1", "adv_floor")  # minibatch fields without a pair axis


def make_update_fn(policy: Policy, objective, options, optimizer, config, reward_apply: Callable | None = None,
                   pair_sharding: jax.sharding.NamedSharding | None = None) -> Callable:
    """jit-able `(state, frozen, data, rows, slots, weight) -> (state, stats)`: one optimizer step of the
    objective on its pairs `(rows[m], slots[m])` of the iteration's `data`.

    `train.microbatch` (pairs per forward/backward, 0 = the whole minibatch): the minibatch's M pairs run
    `microbatch` at a time in a `lax.scan` that sums each microbatch's gradient times its share of the weight,
    `W_j / W`, then one optimizer step (the memory plan's update knob). For losses that are weighted means
    over pairs (grpo, nft, advantage_flow) this is the whole minibatch's gradient; a statistic over the whole
    minibatch becomes one per microbatch (lambda control's per-step budget test, LeapAlign's softmax), and the
    reported stats are the weight-share means of the microbatches' (exact for the loss and weighted means).
    The objective's randomness is `key` unsplit, or `fold_in(key, j)` for microbatch j. `pair_sharding`: the
    pairs' sharding (the batch axes), imposed on the minibatch so every device computes its own pairs."""
    fns = policy_fns(policy, config.sampler, reward_apply, options.get("train_cfg", 0.0) or None, options.get("detach_uncond", False))
    ema_decay, ema_every = config.train.ema_decay, config.train.ema_every
    microbatch = config.train.get("microbatch", 0)

    def constrain(mb, size):
        return {k: v if k in SHARED_PAIR_FIELDS else parallel.constrain_rows(v, pair_sharding, size) for k, v in mb.items()}

    def value_and_grad(state: TrainState, frozen, data, rows, slots, weight, key):
        mb = constrain(objective.pairs(data, rows, slots, weight, key, options), rows.shape[0])
        if objective.uses_reward_model:
            mb["reward_params"] = frozen["reward"]
        if objective.old_policy is not None:
            mb["old_variables"] = policy.variables(state.old, frozen["dit"])

        def loss(trainable):
            return objective.loss(policy.variables(trainable, frozen["dit"]), {"params": frozen["dit"]}, mb, fns, options)

        return jax.value_and_grad(loss, has_aux=True)(state.params)

    def accumulated(state, frozen, data, rows, slots, weight, key):
        m = rows.shape[0]
        if not microbatch or microbatch >= m:
            return value_and_grad(state, frozen, data, rows, slots, weight, key)
        if m % microbatch:
            raise ValueError(f"train.microbatch={microbatch} must divide the minibatch's {m} pairs")
        total = jnp.maximum(weight.sum(), 1e-8)

        def body(acc, inputs):
            j, rows_j, slots_j, weight_j = inputs
            out = value_and_grad(state, frozen, data, rows_j, slots_j, weight_j, jax.random.fold_in(key, j))
            share = weight_j.sum() / total
            return jax.tree_util.tree_map(lambda a, x: a + share * x, acc, out), None

        chunks = (jnp.arange(m // microbatch),) + tuple(a.reshape(m // microbatch, microbatch) for a in (rows, slots, weight))
        shapes = jax.eval_shape(lambda: value_and_grad(state, frozen, data, *(a[0] for a in chunks[1:]), key))
        zeros = jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
        return jax.lax.scan(body, zeros, chunks)[0]

    def update(state: TrainState, frozen, data, rows, slots, weight):
        key = jax.random.fold_in(jax.random.PRNGKey(config.seed + 2), state.updates)
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
    sigmas = schedule.sigmas(s.num_steps, s.shift)
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
        final = [rollout_lib.rollout(v, x_T, sigmas, levels, k_steps, s.kind, policy.dit.patch_size, s.logprob_form, **tail).final
                 for v in (v_before, v_after, v_mixed)]
        rms = lambda a: jnp.sqrt(jnp.mean(jnp.square(a)))  # noqa: E731
        return {"total": rms(final[1] - final[0]), "trained_steps": rms(final[2] - final[0]), "untrained_steps": rms(final[1] - final[2])}

    return image_change


def initial_state(policy: Policy, optimizer, credit, objective, config, num_prompts: int, frozen_dit, rng) -> TrainState:
    """The TrainState at step 0: the policy's trainable params (and their EMA, optimizer state, old policy) from `rng`."""
    params = policy.init(frozen_dit, rng)
    return TrainState(step=jnp.zeros((), jnp.int32), updates=jnp.zeros((), jnp.int32), params=params, ema=params,
                      opt_state=optimizer.init(params), credit=credit.init(), old=params if objective.old_policy is not None else None,
                      curriculum=jax.tree_util.tree_map(jnp.asarray, curriculum.init(num_prompts)) if config.curriculum.enabled else None)


def update_old_policy(state: TrainState, decay: Callable) -> TrainState:
    """The old policy after an iteration: `old <- d old + (1 - d) params`, `d = decay(updates)`, the optimizer steps
    done, as DiffusionNFT's `return_decay(global_step)` counts them (objectives/__init__.py)."""
    d = decay(state.updates.astype(jnp.float32))
    return state.replace(old=jax.tree_util.tree_map(lambda o, p: d * o + (1 - d) * p, state.old, state.params))


def reward_gradient_fn(reward_model, mesh) -> Callable:
    """`(x [B, H, W, C], prompt rows) -> d R / d x` of the world's reward model (jit), its params replicated
    on `mesh` and the prompt tokens sharded like the batch."""
    apply, params, tokenize = reward_model
    params = parallel.put_global(params, jax.tree_util.tree_map(lambda _: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()), params))
    grad = jax.jit(jax.grad(lambda x, p, i, m: apply(p, x, i, m).sum()))
    return lambda x, prompts: grad(x, params, *parallel.shard_batch(tokenize(prompts), mesh))


def minibatch_pairs(t_cfg, num_slots: int) -> int:
    """Pairs per optimizer step: the iteration's samples x slots over `train.minibatches`, rounded up to a whole
    number of `train.microbatch`es (the padding pairs have weight 0)."""
    pairs = -(-t_cfg.prompts_per_iteration * t_cfg.group_size * num_slots // t_cfg.minibatches)
    micro = t_cfg.get("microbatch", 0)
    return -(-pairs // micro) * micro if micro else pairs


def minibatches(keep: np.ndarray, slots: np.ndarray, size: int, rng: np.random.Generator):
    """(rows, slots, weight) chunks of `size` over the kept samples x training slots, the samples in a
    shuffled order and each sample's pairs together (as Flow-GRPO accumulates all of a sample's steps into
    one optimizer step), so that in the first epoch a chunk's samples are unseen by the updates before it
    (but where a sample straddles two chunks); the last chunk is padded with weight-0 pairs so every update
    has one compiled shape."""
    rows, steps = np.meshgrid(rng.permutation(np.flatnonzero(keep)), slots, indexing="ij")
    pairs = np.stack([rows.ravel(), steps.ravel()], 1)
    for start in range(0, len(pairs), size):
        chunk = pairs[start : start + size]
        weight = np.ones(size, np.float32)
        if len(chunk) < size:
            weight[len(chunk):] = 0.0
            chunk = np.concatenate([chunk, np.repeat(chunk[:1], size - len(chunk), 0)])
        yield chunk[:, 0].astype(np.int32), chunk[:, 1].astype(np.int32), weight


class Steps:
    """The jit-compiled pieces of one iteration on `mesh` (module doc), the initial TrainState, the
    objective's training slots and minibatch size, and the host-side tools of credit schemes."""

    def __init__(self, config, mesh, world, dit, base: dict, credit, num_prompts: int = 0):
        t_cfg = config.train
        self.mesh, self.world = mesh, world
        self.policy = policy = Policy(dit, t_cfg.lora_rank, t_cfg.lora_init)
        self.objective = objective = objectives.get(config.objective.name)
        self.options = options = objectives.resolve_options(config, dit.patch_size)
        optimizer = make_optimizer(t_cfg)
        rules, min_size = config.partition_rules, config.min_fsdp_size
        reward_apply, self._reward_tokenize = None, None
        if objective.uses_reward_model:
            reward_apply, reward_params, self._reward_tokenize = world.reward_model()
            base = {**base, "reward": reward_params}
        frozen_shardings = parallel.tree_shardings(base, mesh, rules, min_size)
        self.frozen = parallel.put_global(base, frozen_shardings)

        init_state = functools.partial(initial_state, policy, optimizer, credit, objective, config, num_prompts, self.frozen["dit"])
        rng = jax.random.fold_in(jax.random.PRNGKey(config.seed), 1)
        self.shardings = parallel.tree_shardings(jax.eval_shape(init_state, rng), mesh, rules, min_size)
        self.state = jax.jit(init_state, out_shardings=self.shardings)(rng)
        data, replicated = parallel.batch_sharding(mesh), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        rollout_fn = make_rollout_fn(policy, world, config, data)
        self._rollout = jax.jit(rollout_fn, in_shardings=(self.shardings.params, frozen_shardings, data, data, replicated, replicated))
        num_chunks = t_cfg.prompts_per_iteration * t_cfg.group_size // t_cfg.rollout_chunk if t_cfg.get("rollout_chunk") else 1
        self._rollout_start = jax.jit(rollout_fn.start, in_shardings=(data, data, replicated), out_shardings=([data] * num_chunks, replicated))
        self._rollout_chunk = jax.jit(rollout_fn.chunk, in_shardings=(self.shardings.params, frozen_shardings, data, replicated, None,
                                                                      replicated), out_shardings=data)
        self._rollout_assemble = jax.jit(rollout_fn.assemble)
        self.credit = jax.jit(make_credit_fn(credit, "step" in objective.offers(options), config.advantage.null_control), static_argnums=3)
        self.complete = jax.jit(make_completion_fn(policy, config), static_argnums=5)
        self.image_change = jax.jit(make_image_change_fn(policy, world, config))
        self.update = jax.jit(make_update_fn(policy, objective, options, optimizer, config, reward_apply, data),
                              out_shardings=(self.shardings, None), donate_argnums=0, compiler_options=compiler.backward_options())
        if objective.old_policy is not None:
            self.update_old_policy = jax.jit(functools.partial(update_old_policy, decay=lambda step: objective.old_policy(step, options)),
                                             out_shardings=self.shardings, donate_argnums=0)
        self.sampler, self.seed = config.sampler, config.seed
        self.levels = np.asarray(sampler_levels(config.sampler))  # the config's window's levels (the default rollout's)
        self.slots = self.slots_at(self.levels)  # its slots (every window of the schedule has its size)
        self.minibatch_size = minibatch_pairs(t_cfg, len(self.slots))
        self._reward_gradient = None

    def levels_at(self, it: int) -> np.ndarray:
        """[T] the noise level per step at iteration `it`: the SDE window of `sampler.window`'s schedule (`sampling.windows`)."""
        return np.asarray(sampler_levels(self.sampler, windows.window_at(self.sampler, it, self.seed)))

    def slots_at(self, levels: np.ndarray) -> np.ndarray:
        """The objective's training slots for a rollout drawn at `levels` (the SDE window's steps, for grpo)."""
        return self.objective.slots(self.options, np.asarray(levels))

    def rollout(self, trainable, frozen, ids, mask, rng, levels=None) -> tuple:
        """-> (Rollout, cond, null) at `levels [T]` (None: the config's fixed window), batch sharded on the mesh."""
        return self._rollout(trainable, frozen, ids, mask, rng, self.levels if levels is None else levels)

    def rollout_in_chunks(self, trainable, frozen, ids, mask, rng, on_chunk: Callable, levels=None) -> tuple:
        """`rollout` (with `train.rollout_chunk`) run one chunk per call from the host: `on_chunk(i, (ro_i, cond_i, null_i))`
        as soon as chunk i is dispatched (its rows: `parallel.to_row_chunks`' chunk i), while chunk i + 1 samples.
        -> (Rollout, cond, null)."""
        levels = self.levels if levels is None else levels
        pieces, k_steps = self._rollout_start(ids, mask, rng)
        outs = []
        for i, rows in enumerate(pieces):
            outs.append(self._rollout_chunk(trainable, frozen, rows, k_steps, np.int32(i), levels))
            on_chunk(i, outs[-1])
        return self._rollout_assemble(outs, levels)

    def objective_extras(self, prompts_local: list[dict]) -> dict:
        """The objective's host-side inputs for this iteration (the reward model's tokens), batch-sharded."""
        if self._reward_tokenize is None:
            return {}
        ids, mask = self._reward_tokenize(prompts_local)
        return dict(zip(("reward_ids", "reward_mask"), parallel.shard_batch((ids, mask), self.mesh)))

    def context(self, state: TrainState, ro, cond, null, prompts_local, reward_fn) -> Context:
        """The credit schemes' host-side tools for this iteration (`credit.context`)."""
        def complete(states, steps):
            return self.complete(state.params, self.frozen, cond, null, states, tuple(int(t) for t in steps))

        def reward_gradient(x, prompts):
            if self._reward_gradient is None:  # built on first use: only spatial credit needs it
                self._reward_gradient = reward_gradient_fn(self.world.reward_model(), self.mesh)
            return self._reward_gradient(x, prompts)

        return Context(ro, prompts_local, reward_fn, self.mesh, complete, reward_gradient,
                       lambda x: self.world.decode(self.frozen, x))
